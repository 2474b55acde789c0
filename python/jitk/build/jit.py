"""load_jit: a kernel file plus template arguments in, a loaded tvm-ffi module out.

The build itself is ninja's (jitk/build/builder.py); the exports are jitk's (jitk/export.h, on
tvm-ffi's C ABI, which keeps tvm-ffi's C++ headers and their seconds of parsing out of every
kernel build). jitk adds what tvm-ffi leaves to its callers: a cache key over the kernel files,
the generated sources, the flags and the compiler versions, independent of where jitk is
installed, with the digests of the headers each build read checked on every lookup and the
target architectures named after it (a lookup takes an entry built for more); a cache that
readers use without locks or writes once they have checked who could have written it
(jitk/build/trust.py), filled by builds published in one rename (jitk/build/cache.py,
jitk/build/builder.py); a mode that never compiles; compile errors that show the compiler's
own lines; and a load-time check that the library holds code for the GPU it is about to run
on."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shlex
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import tvm_ffi

from jitk.base import settings
from jitk.base.errors import ArgumentError, ArgumentTypeError, JitkError
from jitk.build import cache, entries, events, nvrtc, pch, remote, toolchain, versions
from jitk.build.build_errors import JitCompileError
from jitk.build.builder import HOST_HALF, build_and_publish, host_half_unit
from jitk.build.cpus import spare_cpus
from jitk.build.lock import build_lock, lock_timeout
from jitk.build.spec import BuildSpec

__all__ = ["JitCacheMissError", "JitCompileError", "disable_jit", "load_jit"]

logger = logging.getLogger("jitk")

PACKAGE_DIR = cache.PACKAGE_DIR
INCLUDE_DIR = PACKAGE_DIR / "include"
KERNEL_DIR = PACKAGE_DIR / "kernels"  # a folder a family

DEFAULT_CFLAGS = ("-std=c++20", "-O3", "-fPIC")
# nvcc's -O is the host compiler's level only (cicc and ptxas optimise device code fully
# whatever it is): the host side of a .cu is launch wrappers, which need little, and -O1
# leaves the kernels' machine code byte for byte the same (debugging_and_performance.md).
DEFAULT_CUDA_CFLAGS = ("-std=c++20", "-O1", "--expt-relaxed-constexpr", "-Xcompiler=-fPIC")
# Bind every symbol at load: a missing one fails the builder's load, before publication,
# rather than killing the process at the first call that needs it.
DEFAULT_LDFLAGS = ("-shared", "-Wl,-z,now")
DISABLE_ENV = "JITK_DISABLE_JIT"
CUDA_COMPILERS = ("nvcc", "nvrtc", "auto")  # what load_jit(cuda_compiler=...) takes
_MAX_NAME = 200  # a module name becomes a folder name, with a key after it

# load_jit's other build for a call, asked only when the first is not cached: its spec, call
# and build key, or None to build the first.
Fallback = Callable[[], "tuple[BuildSpec, dict, str | None] | None"] | None
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_state_lock = threading.Lock()
_disabled_depth = 0  # how many disable_jit() blocks are open, in any thread


class JitCacheMissError(JitkError, RuntimeError):
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
    disabled = settings.flag(DISABLE_ENV)  # a bad value fails even inside disable_jit()
    return _disabled_depth > 0 or disabled


def build_count() -> int:
    """How many modules this process has built (rather than found in the cache)."""
    return events.count("build")


# ------------------------------------------------------------------------------ arguments
def _module_name(parts: tuple[object, ...]) -> str:
    if not parts:
        raise ArgumentError("load_jit needs at least one name part, e.g. load_jit('rmsnorm', ...)")
    for i, part in enumerate(parts):
        if isinstance(part, bool) or not isinstance(part, str | int):
            raise ArgumentTypeError(
                f"load_jit: name part {i} is {type(part).__name__} {part!r:.60}; expected a str "
                "or an int (make_cpp_args renders other values)")
    name = re.sub(r"[^A-Za-z0-9_]+", "_", "_".join(str(p) for p in parts)).strip("_")
    if not name:
        raise ArgumentError(f"load_jit name parts {parts!r} leave no usable module name")
    if len(name) > _MAX_NAME:
        raise ArgumentError(f"load_jit: the module name '{name[:40]}...' has {len(name)} "
                            f"characters; at most {_MAX_NAME} fit a folder name")
    return name


def _listed(value: object, parameter: str, kinds: tuple[type, ...], expected: str,
            one: str = "{!r}") -> list:
    """A list argument: a list or tuple of `kinds` (a bare string is refused: it would be
    read one character at a time). `one` writes a single item from a bare string, for the
    hint."""
    if isinstance(value, str | bytes | os.PathLike) or not isinstance(value, Iterable):
        hint = f"; write {parameter}=[{one.format(str(value))}]" \
            if isinstance(value, str | os.PathLike) else ""
        raise ArgumentTypeError(f"load_jit({parameter}=...) takes a list of {expected}, got "
                                f"{type(value).__name__}{hint}")
    items = list(value)
    for i, item in enumerate(items):
        if not isinstance(item, kinds) or isinstance(item, bool):
            raise ArgumentTypeError(f"load_jit({parameter}[{i}]): expected {expected}, got "
                                    f"{type(item).__name__} {item!r:.60}")
    return items


# A bare kernel file name -> the one family's file of that name, once found: a warm load
# then globs no folder (the package's files stay put while it runs).
_FAMILY_FILES: dict[str, Path] = {}


def _shipped(path: Path) -> Path:
    """A relative kernel file name, the package's own: a path under jitk/kernels
    ("norm/rmsnorm.cuh"), or the bare name of a file that one family holds ("rmsnorm.cuh")."""
    if len(path.parts) == 1 and path.name in _FAMILY_FILES:
        return _FAMILY_FILES[path.name]
    found = KERNEL_DIR / path
    if not found.exists() and len(path.parts) == 1:
        held = sorted(KERNEL_DIR.glob(f"*/{path.name}"))
        if len(held) == 1:
            _FAMILY_FILES[path.name] = held[0]
            return held[0]
    return found


def _resolve_sources(files: object, parameter: str) -> list[Path]:
    resolved = []
    for file in _listed(files, parameter, (str, os.PathLike), "paths (str or os.PathLike)"):
        path = Path(file)
        found = path if path.is_absolute() else _shipped(path)
        if found.is_dir():
            raise IsADirectoryError(f"load_jit({parameter}=...): '{found}' is a folder; give "
                                    "the kernel files in it, each by its path")
        if not found.is_file():
            where = " (a path that is not absolute names a file in the jitk package; give " \
                "an absolute path for your own)" if not path.is_absolute() else ""
            raise FileNotFoundError(f"load_jit({parameter}=...): '{found}' not found{where}")
        resolved.append(found.resolve())
    return resolved


def _as_given(path: Path) -> str:
    """A resolved kernel file as load_jit takes it: a path under jitk/kernels, else
    absolute."""
    if not path.is_relative_to(KERNEL_DIR):
        return str(path)
    return path.name if _shipped(Path(path.name)) == path else str(path.relative_to(KERNEL_DIR))


def _check_wrappers(wrappers: object, parameter: str) -> list[tuple[str, str]]:
    checked = []
    for wrapper in _listed(wrappers, parameter, (tuple, list), "(export_name, cpp_callable)",
                           one="({!r}, '<C++ function or static member>')"):
        if len(wrapper) != 2 or not all(isinstance(part, str) for part in wrapper):
            raise ArgumentTypeError(f"load_jit({parameter}=...): expected (export_name, "
                                    f"cpp_callable) as two strings, got {wrapper!r}")
        export_name, callable_name = wrapper
        if not _IDENTIFIER.match(export_name):
            raise ArgumentError(f"load_jit({parameter}=...): export name {export_name!r} is not "
                                "a C identifier")
        if not callable_name.strip() or "\n" in callable_name:
            raise ArgumentError(f"load_jit({parameter}=...): {callable_name!r} for "
                                f"'{export_name}' is not a C++ name")
        checked.append((export_name, callable_name))
    return checked


def _check_build_directory(value: object) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, str | os.PathLike) or not str(value):
        raise ArgumentTypeError(f"load_jit(build_directory=...): expected a path or None, got "
                                f"{type(value).__name__} {value!r:.60}")
    folder = Path(value).expanduser().resolve()
    cache.check_build_directory(folder)
    return folder


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


def _cache_key(material: dict, sources: list[Path]) -> str:
    """A digest of what names a build (module name, generated sources, flags, compiler and
    tvm-ffi versions, kernel files), with the package's location taken out: installations of
    the same jitk share entries. The headers are not in it: an entry records the ones its
    build read, with their digests, and a lookup that finds one changed rebuilds
    (builder.package_headers, cache.look_up), so a header edit rebuilds only the entries
    that include it."""
    digest = hashlib.sha256()
    text = json.dumps({"format": cache.FORMAT, **material}, sort_keys=True, default=str)
    digest.update(text.replace(str(PACKAGE_DIR), cache.PACKAGE_MARK).encode())
    for path in sources:
        digest.update(cache.portable(path).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


# ------------------------------------------------------------------------------ loading
def precompile_command(call: dict, archs: tuple[str, ...]) -> str:
    """The shell command that builds the entry of a recorded load_jit call (its arguments as
    JSON values, as load_jit records them for a miss): the same call, for the same
    architectures."""
    arch = f" --arch {shlex.quote(';'.join(archs))}" if archs else ""
    text = json.dumps(call, separators=(",", ":"))
    return f"python -m jitk precompile{arch} --call {shlex.quote(text)}"


def _miss_error(spec: BuildSpec, template_args: tuple[object, ...], call: dict,
                problem: str | None, remote_failure: str | None = None) -> JitCacheMissError:
    why = f"its entry cannot be used: {problem}" if problem else "it is not in the cache"
    why += f" nor fetched from the remote cache ({remote_failure})" if remote_failure else ""
    return JitCacheMissError(
        f"jitk: module '{spec.name}' (template arguments: "
        f"{', '.join(map(str, template_args)) or 'none'}; architectures: "
        f"{', '.join(toolchain.sm_name(a) for a in spec.archs) or 'host only'}) is needed, "
        f"but {why} ({spec.entry}) and JIT compilation is disabled ({DISABLE_ENV}=1 or "
        f"jitk.disable_jit()). Fill the cache where compiling is allowed with this entry: "
        f"`{precompile_command(call, spec.archs)}` (or, for a kernel module's common "
        "configurations, `python -m jitk precompile`).")


def _build_and_load(spec: BuildSpec, template_args: tuple[object, ...], call: dict,
                    build_key: str | None, fallback: Fallback = None
                    ) -> tuple[tvm_ffi.Module, tuple[str, ...]]:
    """The module of `spec` and the architectures it holds code for, as one event
    (jitk/build/events.py): a failure after the lookup is a "miss". Where `spec` is not
    cached, `fallback` may give another build to find or make instead."""
    disabled = jit_disabled()  # a bad setting fails every load, not only a miss
    lock_timeout()
    started, source, phases = time.perf_counter(), "miss", {}
    try:
        module, archs, problem = entries.load_cached(spec, build_key)
        if not module and fallback and (instead := fallback()):
            spec, call, build_key = instead
            module, archs, problem = entries.load_cached(spec, build_key)
        if module:
            source = "disk"
        else:
            module, archs, source, phases = _find_or_make(spec, template_args, call,
                                                          build_key, disabled, problem)
    finally:
        events.record(spec.name, build_key or spec.key, source, started, phases)
    versions.keep_pending()
    return module, archs


def _find_or_make(spec: BuildSpec, template_args: tuple[object, ...], call: dict,
                  build_key: str | None, disabled: bool, problem: str | None
                  ) -> tuple[tvm_ffi.Module, tuple[str, ...], str, dict[str, float]]:
    """The module, its architectures, where it came from ("disk", "remote" or "build") and
    a build's phases (builder.PHASES; none for the others), after a reader found no complete,
    intact entry (or, given `build_key`, one for more architectures) for the reason
    `problem`: fetched from the remote cache, where one is set (jitk/build/remote.py), or
    built, under the entry's lock."""
    shared = not spec.in_place and remote.configured() is not None
    if disabled and not shared:
        raise _miss_error(spec, template_args, call, problem)
    if spec.archs and not disabled:
        toolchain.check_buildable(spec.archs)
    with build_lock(cache.build_lock_path(spec.entry, spec.in_place), spec.entry):
        # another process may have built (or fetched) it meanwhile
        module, archs, problem = entries.load_cached(spec, build_key)
        if module:
            return module, archs, "disk", {}
        missed = remote.fetch(spec.entry, spec.key, spec.archs) if shared else None
        if shared and not missed:  # fetched, verified and published
            module, archs, problem = entries.load_cached(spec, build_key)
            if module:
                return module, archs, "remote", {}
        if disabled:
            raise _miss_error(spec, template_args, call, problem, missed)
        if problem:
            logger.warning("jitk: cached %s did not load (%s); rebuilding", spec.entry, problem)
        built = build_and_publish(spec)
        if shared:
            remote.push_built(spec.entry)
    return built.module, spec.archs, "build", built.phases


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
    cuda_compiler: str = "nvcc",
    host_units: int = 1,
) -> tvm_ffi.Module:
    """Build (or find in the cache) and load a module.

    name_parts (str or int) are joined with '_' into the module name; the parts after the
    first are its template arguments. Files are absolute paths, or names of the package's
    own kernel files ("rmsnorm.cuh", "norm/rmsnorm.cuh"); C++
    files are compiled by the host compiler, CUDA files by nvcc. Each wrapper
    (export_name, cpp_callable) exports `cpp_callable` (a function or a template
    instantiation's static member, e.g. "MyKernel<128, bf16_t>::run") as `export_name`.
    `build_directory` replaces the cache entry's folder: a new folder, an empty one or one
    that jitk built before (a folder holding other files is refused). `min_arch` (e.g.
    "9.0") is the oldest GPU architecture the CUDA code builds for: an older target is
    refused, naming the module, before anything is compiled. A cached entry built for more
    architectures than the targets (precompile --arch "8.0 9.0 10.0") serves them when it
    holds machine code (or, once noted, PTX) for each. Under JITK_DISABLE_JIT=1 or
    jitk.disable_jit(), a module not in the cache raises JitCacheMissError.
    `cuda_compiler="nvrtc"` builds CUDA files written in two halves (<jitk/nvrtc.cuh>): the
    host compiler alone builds the host half, NVRTC the kernels it launches, in the process;
    "auto" builds such files as JITK_CUDA_COMPILER says (nvrtc.choose). There,
    `host_units` shares the cuda_wrappers out over up to that many host translation units
    (at most one a wrapper and one an idle CPU), which the host compiler builds side by side:
    for kernel files that hold only inline and template definitions, as jitk's own do, since
    each unit reads them (a namespace-scope `static` would be one a unit). How many units a
    build uses is not in the entry's key: it depends on the machine and its load, not on what
    is built. nvcc builds one unit.
    """
    name = _module_name(name_parts)
    cpp_paths = _resolve_sources(cpp_files, "cpp_files")
    cuda_paths = _resolve_sources(cuda_files, "cuda_files")
    cpp_exports = _check_wrappers(cpp_wrappers, "cpp_wrappers")
    cuda_exports = _check_wrappers(cuda_wrappers, "cuda_wrappers")
    if not (cpp_exports or cuda_exports):
        raise ArgumentError(f"load_jit('{name}'): no cpp_wrappers or cuda_wrappers, so the "
                            "module would export nothing")
    exported = [export for export, _ in cpp_exports + cuda_exports]
    if twice := sorted({e for e in exported if exported.count(e) > 1}):
        raise ArgumentError(f"load_jit('{name}'): export name(s) {', '.join(twice)} given twice")
    flags = {p: _listed(v, p, (str,), "strings") for p, v in (
        ("extra_cflags", extra_cflags), ("extra_cuda_cflags", extra_cuda_cflags),
        ("extra_ldflags", extra_ldflags))}
    includes = _listed(extra_include_paths, "extra_include_paths", (str, os.PathLike),
                       "paths (str or os.PathLike)")
    build_dir = _check_build_directory(build_directory)
    if not isinstance(cuda_compiler, str) or cuda_compiler not in CUDA_COMPILERS:
        listed = ", ".join(map(repr, CUDA_COMPILERS[:-1])) + f" or {CUDA_COMPILERS[-1]!r}"
        raise ArgumentError(f"load_jit(cuda_compiler=...): {listed}, got {cuda_compiler!r}")
    if isinstance(host_units, bool) or not isinstance(host_units, int) or host_units < 1:
        error = ArgumentError if isinstance(host_units, int) else ArgumentTypeError
        raise error(f"load_jit('{name}', host_units=...): expected an int of at least 1, got "
                    f"{host_units!r}")
    wanted = nvrtc.preferred(cuda_compiler)
    split = wanted == "nvrtc" or (wanted == "auto" and nvrtc.installed())
    if split and flags["extra_cuda_cflags"]:
        raise ArgumentError(f"load_jit('{name}'): extra_cuda_cflags are nvcc's; with "
                            "cuda_compiler='nvrtc' there is no nvcc to give them to")
    if min_arch is not None and not (isinstance(min_arch, str)
                                     and re.fullmatch(r"\d+\.\d+", min_arch)):
        raise ArgumentError(f"load_jit(min_arch=...): expected one architecture such as '9.0', "
                            f"got {min_arch!r}")

    has_cpp = bool(cpp_paths or cpp_exports)
    has_cuda = bool(cuda_paths or cuda_exports)
    archs = toolchain.canonical_archs(toolchain.target_archs()) if has_cuda else ()
    if archs and min_arch is not None:
        toolchain.check_min_arch(name, archs, min_arch)

    def plan(split: bool) -> tuple[BuildSpec, dict, str | None]:
        """The build of this call, with the host half and NVRTC (`split`) or with nvcc."""
        sources = {}  # file name -> text: main.cpp for the host compiler, cuda.cu for nvcc
        if has_cpp:
            sources["main.cpp"] = _render_source(name, cpp_paths, cpp_exports, False)
        if has_cuda:  # nvcc's unit, or the host half of one that NVRTC completes
            sources[HOST_HALF if split else "cuda.cu"] = _render_source(name, cuda_paths,
                                                                        cuda_exports, True)
        build_flags = {
            "cflags": [*DEFAULT_CFLAGS, *flags["extra_cflags"]],
            "cuda_cflags": [*DEFAULT_CUDA_CFLAGS, *flags["extra_cuda_cflags"]],
            "ldflags": [*DEFAULT_LDFLAGS, *flags["extra_ldflags"]],
            "include_dirs": [str(INCLUDE_DIR), *(str(Path(p).resolve()) for p in includes)],
        }
        compilers = toolchain.compiler_versions(toolchain.compilers(cuda=has_cuda and not split))
        if split and has_cuda:
            # the prelude in the key: entries built before it did not record NVRTC's headers
            compilers.append("nvrtc {}.{} {} {}".format(*nvrtc.version(), nvrtc.OPTIONS,
                                                       nvrtc.PRELUDE.strip()))
        kernel_files = cpp_paths + cuda_paths
        # The architectures are not in the build's key but in the folder's name, after it, so
        # that a process can find an entry built for more architectures than it asks for.
        build_key = _cache_key({"name": name, "compilers": compilers,
                                "tvm_ffi": tvm_ffi.__version__, "sources": sources,
                                "flags": build_flags}, kernel_files)
        entry = build_dir or cache.cache_root().expanduser().resolve() / entries.folder_name(
            name, build_key, archs)
        units = min(host_units, len(cuda_exports), spare_cpus()) if split else 1
        if units > 1:  # the wrappers dealt out; the key is the one unit's
            sources = {**{file: text for file, text in sources.items() if file != HOST_HALF},
                       **{host_half_unit(unit): pch.unit_preamble(unit == 0) + _render_source(
                           name, cuda_paths, cuda_exports[unit::units], True)
                          for unit in range(units)}}
        spec = BuildSpec(name, entry, entries.entry_key(build_key, archs), build_dir is not None,
                         archs, sources, tuple(kernel_files), build_flags,
                         tuple(cuda_paths) if split else ())
        # The call as `python -m jitk precompile --call` replays it: the arguments given, with
        # include folders made absolute (a kernel file's relative name is the package's own).
        call = {"name_parts": list(name_parts), "cpp_files": list(map(_as_given, cpp_paths)),
                "cuda_files": list(map(_as_given, cuda_paths)), "cpp_wrappers": cpp_exports,
                "cuda_wrappers": cuda_exports, **flags,
                "extra_include_paths": build_flags["include_dirs"][1:],
                "build_directory": str(build_dir) if build_dir else None,
                "min_arch": min_arch,
                "cuda_compiler": None if cuda_compiler == "nvcc" else cuda_compiler,
                "host_units": None if host_units == 1 else host_units}
        call = {key: value for key, value in call.items() if value}
        return spec, call, None if build_dir else build_key

    spec, call, build_key = plan(split)
    # "auto" looks for NVRTC's build first: only a miss asks whether NVRTC can build here
    # (finding the toolkit may run nvcc), and where it cannot, nvcc's build is used.
    fallback = ((lambda: None if nvrtc.builds_here() else plan(False))
                if split and wanted == "auto" else None)
    module, held = _build_and_load(spec, name_parts[1:], call, build_key, fallback)
    if held:
        toolchain.check_runs_on_current_gpu(name, held)
    return module
