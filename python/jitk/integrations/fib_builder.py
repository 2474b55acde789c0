"""jitk as a FlashInfer-Bench builder: `language: cuda` (or `cpp`) / `binding: tvm-ffi`
Solutions built by jitk.load_jit, so they share its content-keyed cache, its lock-free loads
and its compile errors, whose decisive lines reach flashinfer-bench's BuildError.

A Solution's sources are written, once, to FIB_CACHE_PATH/jitk/<name>_<content hash>/ (that
folder is also on the include path). The compiled files are its `.cu` files (or `.cpp`, for
`language: cpp`), and its entry file when that is a header, as jitk kernels are. Each
`TVM_FFI_DLL_EXPORT_TYPED_FUNC(name, function)` line of the sources becomes a jitk export of
`function` as `name` (the written copy keeps the line as a comment, so line numbers in
errors match the Solution's); an entry point that no such line exports is exported as it is,
so a jitk-style Solution needs no export line at all.

Import this module only where flashinfer-bench is installed; jitk.fib.install_builder()
does."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from flashinfer_bench.compile import Builder, BuildError, Runnable, RunnableMetadata
from flashinfer_bench.data import Definition, Solution, SupportedBindings, SupportedLanguages
from flashinfer_bench.env import get_fib_cache_path

from jitk.build import toolchain
from jitk.build.build_errors import JitCompileError
from jitk.build.jit import JitCacheMissError, load_jit

__all__ = ["JitkBuilder"]

BUILD_TYPE = "jitk"
_EXPORT_LINE = re.compile(
    r"^[ \t]*TVM_FFI_DLL_EXPORT_TYPED_FUNC\(\s*(\w+)\s*,\s*([^;]+?)\s*\)\s*;?[ \t]*$",
    re.MULTILINE)
_COMPILED = {SupportedLanguages.CUDA: (".cu",), SupportedLanguages.CPP: (".cpp", ".cc", ".cxx")}
_HEADERS = (".cuh", ".h", ".hpp")


def _exports_of(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The source with its tvm-ffi export lines commented out, and (name, function) pairs."""
    pairs = [(m.group(1), m.group(2)) for m in _EXPORT_LINE.finditer(text)]
    return _EXPORT_LINE.sub(lambda m: f"// exported by jitk: {m.group(0).strip()}", text), pairs


def _write_if_changed(path: Path, text: str) -> None:
    """Write `text` to `path` through a rename, so a concurrent build reads whole files."""
    if path.is_file() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(handle, "w") as file:
        file.write(text)
    os.replace(staging, path)


class JitkBuilder(Builder):
    """Builds CUDA and C++ tvm-ffi Solutions with jitk.load_jit."""

    def __init__(self) -> None:
        super().__init__("jitk_", BUILD_TYPE)

    @staticmethod
    def is_available() -> bool:
        try:
            toolchain.nvcc_path()
        except toolchain.ToolchainError:
            return False
        return True

    def can_build(self, solution: Solution) -> bool:
        return (solution.spec.language in _COMPILED
                and solution.spec.binding in (None, SupportedBindings.TVM_FFI))

    def source_dir(self, solution: Solution) -> Path:
        """Where the Solution's sources are written: one folder per content."""
        name = re.sub(r"\W", "_", solution.name)
        return get_fib_cache_path() / BUILD_TYPE / f"{name}_{solution.hash()[:16]}"

    def build(self, definition: Definition, solution: Solution) -> Runnable:
        if not self.can_build(solution):
            raise BuildError(f"jitk builds cuda and cpp Solutions with the tvm-ffi binding; "
                             f"'{solution.name}' is {solution.spec.language.value} with "
                             f"{solution.spec.binding}")
        folder = self.source_dir(solution)
        entry_file, symbol = solution.get_entry_path(), solution.get_entry_symbol()
        compiled_suffixes = _COMPILED[solution.spec.language]
        compiled, exports = [], []
        for source in solution.sources:
            text, pairs = _exports_of(source.content)
            exports += pairs
            path = folder / source.path
            _write_if_changed(path, text)
            if path.suffix in compiled_suffixes or (Path(source.path) == entry_file
                                                    and path.suffix in _HEADERS):
                compiled.append(path)
        if symbol not in (name for name, _ in exports):
            exports.append((symbol, symbol))
        if not compiled:
            raise BuildError(f"Solution '{solution.name}' has no file to compile (expected "
                             f"{' or '.join(compiled_suffixes)} files, or a header entry file)")
        files, wrappers = ("cuda_files", "cuda_wrappers") \
            if solution.spec.language is SupportedLanguages.CUDA else ("cpp_files", "cpp_wrappers")
        try:
            module = load_jit("fib", folder.name, **{files: compiled, wrappers: exports},
                              extra_include_paths=[folder])
        except JitCompileError as error:
            lines = "\n".join(error.errors) or error.log.strip()[-4000:]
            raise BuildError(f"jitk failed to compile Solution '{solution.name}':\n{lines}"
                             ) from error
        except (JitCacheMissError, toolchain.ToolchainError, ValueError, TypeError) as error:
            raise BuildError(f"jitk cannot build Solution '{solution.name}': {error}") from error
        try:
            function = getattr(module, symbol)
        except AttributeError:
            raise BuildError(f"Solution '{solution.name}': entry point '{symbol}' is not "
                             "exported by the built module") from None
        self._try_validate_signature(function, definition, solution)  # where it can read one
        metadata = RunnableMetadata(
            build_type=BUILD_TYPE, definition_name=definition.name, solution_name=solution.name,
            destination_passing_style=solution.spec.destination_passing_style,
            definition=definition, misc={"entry_symbol": symbol, "sources": str(folder)})
        return Runnable(callable=function, metadata=metadata)
