"""load_jit: a kernel file plus template arguments in, a loaded tvm-ffi module out.

The build itself is tvm-ffi's (ninja); the exports are jitk's (jitk/export.h, on tvm-ffi's
C ABI, which keeps tvm-ffi's C++ headers and their seconds of parsing out of every kernel
build). jitk adds what tvm-ffi leaves to its callers: a cache key over the contents of every
header and kernel file and the compiler versions, independent of where jitk is installed,
with the target architectures named after it (a lookup takes an entry built for more); a
cache that readers use without locks or writes, filled by builds published in one rename
(jitk/cache.py, jitk/build.py); a mode that never compiles; compile errors that show the
compiler's own lines; and a load-time check that the library holds
code for the GPU it is about to run on."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shlex
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import tvm_ffi

from . import cache, toolchain
from .build import BuildSpec, JitCompileError, build_and_publish
from .lock import build_lock

__all__ = ["JitCacheMissError", "JitCompileError", "disable_jit", "load_jit"]

logger = logging.getLogger("jitk")

PACKAGE_DIR = cache.PACKAGE_DIR
INCLUDE_DIR = PACKAGE_DIR / "include"
KERNEL_DIR = PACKAGE_DIR / "csrc"

DEFAULT_CFLAGS = ("-std=c++20", "-O3")
DEFAULT_CUDA_CFLAGS = ("-std=c++20", "-O3", "--expt-relaxed-constexpr")
# Bind every symbol at load: a missing one fails the builder's load, before publication,
# rather than killing the process at the first call that needs it.
DEFAULT_LDFLAGS = ("-Wl,-z,now",)
DISABLE_ENV = "JITK_DISABLE_JIT"
_MAX_NAME = 200  # a module name becomes a folder name, with a key after it

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_state_lock = threading.Lock()
_disabled_depth = 0  # how many disable_jit() blocks are open, in any thread
_builds = 0  # modules this process has built


class JitCacheMissError(RuntimeError):
    """A module is not in the cache (or its entry cannot be used) while JIT compilation is
    disabled (JITK_DISABLE_JIT=1 or jitk.disable_jit())."""


@contextlib.contextmanager
def disable_jit() -> Iterator[None]:
    """Inside the block, for the whole process, a module missing from the cache raises
    JitCacheMissError instead of being compiled, as under JITK_DISABLE_JIT=1."""
    global _disabled_depth
    with _state_lock:
        _disabled_depth += 1
    try:
        yield
    finally:
        with _state_lock:
            _disabled_depth -= 1


def jit_disabled() -> bool:
    value = os.environ.get(DISABLE_ENV, "").strip().lower()
    if value not in ("", "0", "1", "false", "true", "no", "yes", "off", "on"):
        raise ValueError(f"{DISABLE_ENV}={value!r}: expected 1 (never compile) or 0")
    return _disabled_depth > 0 or value in ("1", "true", "yes", "on")


def build_count() -> int:
    """How many modules this process has built (rather than found in the cache)."""
    return _builds


# ------------------------------------------------------------------------------ arguments
def _module_name(parts: tuple[object, ...]) -> str:
    if not parts:
        raise ValueError("load_jit needs at least one name part, e.g. load_jit('rmsnorm', ...)")
    for i, part in enumerate(parts):
        if isinstance(part, bool) or not isinstance(part, str | int):
            raise TypeError(f"load_jit: name part {i} is {type(part).__name__} {part!r:.60}; "
                            "expected a str or an int (make_cpp_args renders other values)")
    name = re.sub(r"[^A-Za-z0-9_]+", "_", "_".join(str(p) for p in parts)).strip("_")
    if not name:
        raise ValueError(f"load_jit name parts {parts!r} leave no usable module name")
    if len(name) > _MAX_NAME:
        raise ValueError(f"load_jit: the module name '{name[:40]}...' has {len(name)} "
                         f"characters; at most {_MAX_NAME} fit a folder name")
    return name


def _listed(value: object, parameter: str, kinds: tuple[type, ...], expected: str) -> list:
    """A list argument: a list or tuple of `kinds` (a bare string is refused: it would be
    read one character at a time)."""
    if isinstance(value, str | bytes | os.PathLike) or not isinstance(value, Iterable):
        hint = f"; write {parameter}=[{value!r}]" if isinstance(value, str | os.PathLike) else ""
        raise TypeError(f"load_jit({parameter}=...) takes a list of {expected}, got "
                        f"{type(value).__name__}{hint}")
    items = list(value)
    for i, item in enumerate(items):
        if not isinstance(item, kinds) or isinstance(item, bool):
            raise TypeError(f"load_jit({parameter}[{i}]): expected {expected}, got "
                            f"{type(item).__name__} {item!r:.60}")
    return items


def _resolve_sources(files: object, parameter: str) -> list[Path]:
    resolved = []
    for file in _listed(files, parameter, (str, os.PathLike), "paths (str or os.PathLike)"):
        path = Path(file)
        found = path if path.is_absolute() else KERNEL_DIR / path
        if not found.is_file():
            where = "" if path.is_absolute() else f" in {KERNEL_DIR}"
            raise FileNotFoundError(
                f"load_jit({parameter}=...): '{file}' not found{where}; "
                "give an absolute path for a file outside the jitk package"
            )
        resolved.append(found.resolve())
    return resolved


def _check_wrappers(wrappers: object, parameter: str) -> list[tuple[str, str]]:
    checked = []
    for wrapper in _listed(wrappers, parameter, (tuple, list), "(export_name, cpp_callable)"):
        if len(wrapper) != 2 or not all(isinstance(part, str) for part in wrapper):
            raise TypeError(f"load_jit({parameter}=...): expected (export_name, cpp_callable) "
                            f"as two strings, got {wrapper!r}")
        export_name, callable_name = wrapper
        if not _IDENTIFIER.match(export_name):
            raise ValueError(f"load_jit({parameter}=...): export name {export_name!r} is not "
                             "a C identifier")
        if not callable_name.strip() or "\n" in callable_name:
            raise ValueError(f"load_jit({parameter}=...): {callable_name!r} for "
                             f"'{export_name}' is not a C++ name")
        checked.append((export_name, callable_name))
    return checked


def _check_build_directory(value: object) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, str | os.PathLike) or not str(value):
        raise TypeError(f"load_jit(build_directory=...): expected a path or None, got "
                        f"{type(value).__name__} {value!r:.60}")
    return Path(value).expanduser().resolve()


# ------------------------------------------------------------------------------ the key
def _render_source(module: str, files: list[Path], wrappers: list[tuple[str, str]],
                   cuda: bool) -> str:
    lines = [f"// Generated by jitk.load_jit for module '{module}'.", "#include <jitk/export.h>"]
    if cuda:  # make_cpp_args names dtypes by these aliases
        lines += ["#include <jitk/utils.cuh>", "using jitk::fp16_t, jitk::bf16_t, jitk::fp32_t;"]
    lines += [f'#include "{path}"' for path in files]
    lines.append("#include <jitk/tvm_ffi_types.h>")  # tvm-ffi's types, if the kernel uses them
    # The parentheses keep commas in template arguments away from the macro.
    lines += [f"JITK_EXPORT({name}, ({target}))" for name, target in wrappers]
    return "\n".join(lines) + "\n"


def _hash_tree(digest: hashlib._Hash, root: Path) -> None:
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())


def _cache_key(material: dict, sources: list[Path]) -> str:
    """A digest of everything that goes into a build, with the package's location taken
    out: installations of the same jitk share entries."""
    digest = hashlib.sha256()
    text = json.dumps({"format": cache.FORMAT, **material}, sort_keys=True, default=str)
    digest.update(text.replace(str(PACKAGE_DIR), cache.PACKAGE_MARK).encode())
    _hash_tree(digest, INCLUDE_DIR)  # any jitk header edit rebuilds everything
    for path in sources:
        digest.update(cache.portable(path).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# ------------------------------------------------------------------------------ loading
def _caller_module() -> str | None:
    """The module that called load_jit, for the hint of a cache miss."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") in (__name__, "functools"):
        frame = frame.f_back
    return frame.f_globals.get("__name__") if frame is not None else None


def _miss_error(spec: BuildSpec, template_args: tuple[object, ...],
                problem: str | None) -> JitCacheMissError:
    caller = _caller_module()
    has_configs = callable(getattr(sys.modules.get(caller or ""), "precompile_configs", None))
    arch = f" --arch {shlex.quote(';'.join(spec.archs))}" if spec.archs else ""
    if has_configs:
        extra = "" if caller.startswith("jitk.") else f"JITK_PRECOMPILE_MODULES={caller} "
        fill = (f"`{extra}python -m jitk precompile{arch} --module {caller}` (its common "
                "configurations; add this one to its precompile_configs() if it is not there)")
    else:
        fill = (f"one run of this call with compiling allowed, or `JITK_PRECOMPILE_MODULES="
                f"<your module> python -m jitk precompile{arch}` once your module's "
                "precompile_configs() lists it")
    why = f"its entry cannot be used: {problem}" if problem else "it is not in the cache"
    return JitCacheMissError(
        f"jitk: module '{spec.name}' (template arguments: "
        f"{', '.join(map(str, template_args)) or 'none'}; architectures: "
        f"{', '.join(toolchain.sm_name(a) for a in spec.archs) or 'host only'}) is needed, "
        f"but {why} ({spec.entry}) and JIT compilation is disabled ({DISABLE_ENV}=1 or "
        f"jitk.disable_jit()). Fill the cache where compiling is allowed, with {fill}.")


def _load_published(library: Path) -> tvm_ffi.Module | None:
    """The loaded library, or None when its entry vanished meanwhile (a cache clear)."""
    try:
        return tvm_ffi.load_module(str(library))
    except Exception:
        if library.exists():
            raise
        return None


def _usable(entry: Path) -> cache.Lookup:
    found = cache.look_up(entry)
    if found.problem:  # perhaps read while another process replaced the entry: look again
        found = cache.look_up(entry)
    return found


def _covering_entries(spec: BuildSpec) -> list[tuple[Path, tuple[str, ...]]]:
    """Entries of the same build for other sets of architectures (same folder name up to
    the architectures' tag) that serve every architecture of `spec`, those with machine
    code for all of them first. Read only when the exact entry is missing."""
    prefix = spec.entry.name.rsplit("_", 1)[0] + "_"
    try:
        names = sorted(name for name in os.listdir(spec.entry.parent) if name.startswith(prefix)
                       and "." not in name and name != spec.entry.name)
    except OSError:
        return []
    ranked = []
    for name in names:
        meta = cache.read_meta(spec.entry.parent / name) or {}
        try:
            built = toolchain.parse_archs(";".join(map(str, meta.get("archs") or ())))
        except toolchain.ToolchainError:
            continue  # not an entry of this build; look_up would refuse it anyway
        ways = [toolchain.serves(built, wanted) for wanted in spec.archs]
        if all(ways):
            ranked.append(("ptx" in ways, name, built))
    return [(spec.entry.parent / name, built) for _, name, built in sorted(ranked)]


def _load_cached(spec: BuildSpec, any_archs: bool
                 ) -> tuple[tvm_ffi.Module | None, tuple[str, ...], str | None]:
    """The module from the exact entry, else (when `any_archs`) from an entry for more
    architectures that covers these; with the architectures it holds, or why the exact
    entry cannot be used."""
    found = _usable(spec.entry)
    if found.library and (module := _load_published(found.library)):
        return module, spec.archs, None
    for entry, built in _covering_entries(spec) if any_archs and spec.archs else ():
        other = _usable(entry)
        if other.library and (module := _load_published(other.library)):
            logger.info("jitk: %s for %s served by %s", spec.name, ", ".join(spec.archs), entry)
            return module, built, None
    return None, spec.archs, found.problem


def _build_and_load(spec: BuildSpec, template_args: tuple[object, ...], any_archs: bool
                    ) -> tuple[tvm_ffi.Module, tuple[str, ...], bool]:
    """The module of `spec`, the architectures it holds code for and whether this call built
    it. A complete, intact entry is loaded without a lock or a write; anything else is built
    under the entry's lock."""
    global _builds
    disabled = jit_disabled()  # a bad setting fails every load, not only a miss
    module, archs, problem = _load_cached(spec, any_archs)
    if module:
        return module, archs, False
    if disabled:
        raise _miss_error(spec, template_args, problem)
    if spec.archs:
        toolchain.check_buildable(spec.archs)
    with build_lock(spec.entry):
        # another process may have built it meanwhile
        module, archs, problem = _load_cached(spec, any_archs)
        if module:
            return module, archs, False
        if problem:
            logger.warning("jitk: cached %s did not load (%s); rebuilding", spec.entry, problem)
        module = build_and_publish(spec)
    with _state_lock:
        _builds += 1
    return module, spec.archs, True


def load_jit(
    *name_parts: str | int,
    cpp_files: Iterable[str | os.PathLike] = (),
    cuda_files: Iterable[str | os.PathLike] = (),
    cpp_wrappers: Iterable[tuple[str, str]] = (),
    cuda_wrappers: Iterable[tuple[str, str]] = (),
    extra_cflags: Iterable[str] = (),
    extra_cuda_cflags: Iterable[str] = (),
    extra_ldflags: Iterable[str] = (),
    extra_include_paths: Iterable[str | os.PathLike] = (),
    build_directory: str | os.PathLike | None = None,
    min_arch: str | None = None,
) -> tvm_ffi.Module:
    """Build (or find in the cache) and load a module.

    name_parts (str or int) are joined with '_' into the module name; the parts after the
    first are its template arguments. Files are names in jitk/csrc or absolute paths; C++
    files are compiled by the host compiler, CUDA files by nvcc. Each wrapper
    (export_name, cpp_callable) exports `cpp_callable` (a function or a template
    instantiation's static member, e.g. "MyKernel<128, bf16_t>::run") as `export_name`.
    `build_directory` replaces the cache entry's folder. `min_arch` (e.g. "9.0") is the
    oldest GPU architecture the CUDA code builds for: an older target is refused, naming
    the module, before anything is compiled. A cached entry built for more architectures
    than the targets (precompile --arch "8.0 9.0 10.0") serves them when it holds machine
    code (or, once noted, PTX) for each. Under JITK_DISABLE_JIT=1 or
    jitk.disable_jit(), a module not in the cache raises JitCacheMissError.
    """
    name = _module_name(name_parts)
    cpp_paths = _resolve_sources(cpp_files, "cpp_files")
    cuda_paths = _resolve_sources(cuda_files, "cuda_files")
    cpp_exports = _check_wrappers(cpp_wrappers, "cpp_wrappers")
    cuda_exports = _check_wrappers(cuda_wrappers, "cuda_wrappers")
    if not (cpp_exports or cuda_exports):
        raise ValueError(f"load_jit('{name}'): no cpp_wrappers or cuda_wrappers, so the "
                         "module would export nothing")
    exported = [export for export, _ in cpp_exports + cuda_exports]
    if twice := sorted({e for e in exported if exported.count(e) > 1}):
        raise ValueError(f"load_jit('{name}'): export name(s) {', '.join(twice)} given twice")
    flags = {p: _listed(v, p, (str,), "strings") for p, v in (
        ("extra_cflags", extra_cflags), ("extra_cuda_cflags", extra_cuda_cflags),
        ("extra_ldflags", extra_ldflags))}
    includes = _listed(extra_include_paths, "extra_include_paths", (str, os.PathLike),
                       "paths (str or os.PathLike)")
    build_dir = _check_build_directory(build_directory)
    if min_arch is not None and not (isinstance(min_arch, str)
                                     and re.fullmatch(r"\d+\.\d+", min_arch)):
        raise ValueError(f"load_jit(min_arch=...): expected one architecture such as '9.0', "
                         f"got {min_arch!r}")

    has_cpp = bool(cpp_paths or cpp_exports)
    has_cuda = bool(cuda_paths or cuda_exports)
    archs = toolchain.canonical_archs(toolchain.target_archs()) if has_cuda else ()
    if archs and min_arch is not None:
        toolchain.check_min_arch(name, archs, min_arch)
    sources = {}  # generated file name -> text: main.cpp for the host compiler, cuda.cu for nvcc
    if has_cpp:
        sources["main.cpp"] = _render_source(name, cpp_paths, cpp_exports, False)
    if has_cuda:
        sources["cuda.cu"] = _render_source(name, cuda_paths, cuda_exports, True)
    build_kwargs = {
        "extra_cflags": [*DEFAULT_CFLAGS, *flags["extra_cflags"]],
        "extra_cuda_cflags": [*DEFAULT_CUDA_CFLAGS, *flags["extra_cuda_cflags"]],
        "extra_ldflags": [*DEFAULT_LDFLAGS, *flags["extra_ldflags"]],
        "extra_include_paths": [str(INCLUDE_DIR), *(str(Path(p).resolve()) for p in includes)],
    }
    compilers = [toolchain.host_compiler_version()]
    if has_cuda:
        compilers.append(toolchain.nvcc_version())
    kernel_files = cpp_paths + cuda_paths
    # The architectures are not in the key but in the folder's name, after it, so that a
    # process can find an entry built for more architectures than it asks for.
    key = _cache_key({"name": name, "compilers": compilers, "tvm_ffi": tvm_ffi.__version__,
                      "sources": sources, "build_kwargs": build_kwargs}, kernel_files)
    folder = f"{name}_{key}" + (f"_{toolchain.archs_tag(archs)}" if archs else "")
    entry = build_dir or cache.cache_root().expanduser().resolve() / folder
    build_kwargs["extra_cuda_cflags"] += toolchain.ptx_flags(archs)  # named by the tag
    spec = BuildSpec(name, entry, archs, sources, tuple(kernel_files), INCLUDE_DIR,
                     build_kwargs)
    module, held, _ = _build_and_load(spec, name_parts[1:], any_archs=build_dir is None)
    if held:
        toolchain.check_runs_on_current_gpu(name, held)
    return module
