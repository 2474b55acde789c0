"""One build: a module compiled by ninja in a private folder on this host, published as a
cache entry.

The caller holds the entry's build lock (jitk/build/lock.py). The build never touches the
published entry: it happens in a folder of its own on the builder's host (jitk/build/cache.py), is
copied onto the cache's file system, loaded from that copy, and only then becomes the entry,
in one rename. So a reader never sees half a build, a `cache clear` cannot pull a library
from under the process that built it, and a cache on a network file system never holds a
build in progress.

jitk writes build.ninja itself rather than calling `tvm_ffi.cpp.build`: tvm-ffi takes the
compilers, the CUDA root and the target architectures from process-wide environment
variables and runs the `ninja` on PATH, so two threads building at once would have to
share (and fight over) one environment; and it writes paths into build.ninja unescaped, so
a cache folder with a space in its name broke every build. Here everything is explicit:
the programs are found once (jitk/build/toolchain.py) and named by absolute path, every path
and flag is quoted for the shell and escaped for ninja, and nothing in the process's
environment changes. From tvm-ffi jitk takes its headers' and its library's locations
(tvm_ffi.libinfo). ninja runs, by its path, under jitk/build/ninja_guard.py, which stops the
compilers when the builder dies or the build runs past JITK_LOCK_TIMEOUT."""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tvm_ffi
from tvm_ffi.libinfo import find_dlpack_include_path, find_include_path, find_libtvm_ffi

from jitk.build import cache, device_halves, device_prelude, loader, pch, toolchain
from jitk.build.build_errors import JitCompileError, compile_error
from jitk.build.device_halves import DEVICE_HEADERS
from jitk.build.lock import lock_timeout
from jitk.build.spec import BuildSpec
from jitk.build.staging import new_staging, old_stagings

logger = logging.getLogger("jitk")

# The generated unit of a module whose CUDA files are written in two halves (jitk/nvrtc.cuh):
# the host compiler builds it alone, NVRTC the kernels it launches (device_halves).
HOST_HALF = "host_half.cpp"
# A host half may be shared out over several units (load_jit's host_units), compiled side by
# side: the first is HOST_HALF, the others host_half_<n>.cpp.
_HOST_HALF_UNIT = re.compile(r"host_half(_[1-9][0-9]*)?\.cpp")


def host_half_unit(unit: int) -> str:
    """The file name of a host half's `unit`th translation unit (from 0)."""
    return HOST_HALF if unit == 0 else f"host_half_{unit}.cpp"


def is_host_half(source: str) -> bool:
    return _HOST_HALF_UNIT.fullmatch(source) is not None


GUARD = Path(__file__).resolve().parent / "ninja_guard.py"


def _object(source: str) -> str:
    """The object file, and with `.d` its dependency file, of a generated source."""
    return f"{Path(source).stem}.o"


def _ninja_value(text: str) -> str:
    """`text` as the value of a ninja variable ('$' is ninja's escape character)."""
    if "\n" in text:
        raise ValueError(f"jitk cannot build with a line break in a path or flag: {text!r}")
    return text.replace("$", "$$")


def _arguments(*words: object) -> str:
    """Words for the shell that ninja runs each command with, quoted one by one."""
    return _ninja_value(shlex.join(str(word) for word in words))


def gencode_flags(archs: tuple[str, ...]) -> list[str]:
    """nvcc's targets: machine code for each architecture, and for a multi-architecture
    ("fat") build the PTX of its newest generic one (toolchain.ptx_arch), which the driver
    compiles for a GPU newer than the list."""
    flags = [f"-gencode=arch=compute_{a.replace('.', '')},code={toolchain.sm_name(a)}"
             for a in archs]
    if ptx := toolchain.ptx_arch(archs):
        number = ptx.replace(".", "")
        flags.append(f"-gencode=arch=compute_{number},code=compute_{number}")
    return flags


def include_flags(include_dirs: list[str | Path]) -> list[str]:
    """nvcc's and the host compiler's -I flags: `include_dirs`, then tvm-ffi's and DLPack's."""
    return [f"-I{path}" for path in dict.fromkeys(
        [*map(str, include_dirs), find_include_path(), find_dlpack_include_path()])]


def host_half_flags(archs: tuple[str, ...], include_dirs: list[str]) -> list[str]:
    """The host compiler's flags for a host half: the level nvcc gives a host side
    (jit.DEFAULT_CUDA_CFLAGS), and __CUDA_ARCH_LIST__ as nvcc defines it, for what the host
    side decides by the targets (jitk::kPdlOnAllTargets). Hidden by default: each library
    keeps its own kernel list and device code (the statics of jitk/nvrtc.cuh), where default
    visibility binds every library to the first loaded."""
    targets = ",".join(str(toolchain.arch_number(arch)) for arch in archs)
    return ["-std=c++20", "-O1", "-fPIC", "-fvisibility=hidden", *include_flags(include_dirs),
            f"-I{toolchain.cuda_home() / 'include'}",
            *([f"-D__CUDA_ARCH_LIST__={targets}"] if targets else [])]


def _prelude(archs: tuple[str, ...], build: bool = False) -> pch.Prelude | None:
    """The host prelude of host halves for `archs` (pch.prelude; built now if `build`). It is
    compiled with the package's include folder alone, as it reads jitk's headers alone, so
    one serves every module (gcc takes a precompiled header whatever -I folders a unit adds)."""
    flags = host_half_flags(archs, [str(pch.INCLUDE)])
    return (pch.build if build else pch.prelude)(toolchain.host_compiler(), flags)


def build_prelude(archs: tuple[str, ...]) -> None:
    """Builds the host prelude for `archs` now, where the setting has it and it is not there:
    what a batch of builds does first (precompile), so that none of them goes without it."""
    _prelude(archs, build=True)


def build_file(spec: BuildSpec, prelude: pch.Prelude | None = None) -> str:
    """build.ninja for `spec`: the sources are compiled to objects and linked into
    `<name>.so`; a host half reads the precompiled `prelude` first, if given. Build
    statements name only generated files, relative to the build folder (nvcc hands its
    input's path to a shell unescaped); every outside path is in a variable, quoted for the
    shell and escaped for ninja."""
    flags = spec.flags
    includes = include_flags(flags["include_dirs"])
    tvm_ffi_lib = Path(find_libtvm_ffi())
    ldflags = [f"-L{tvm_ffi_lib.parent}", "-l" + tvm_ffi_lib.stem.removeprefix("lib")]
    lines = ["ninja_required_version = 1.3",
             f"cxx = {_arguments(toolchain.host_compiler())}",
             f"cxxflags = {_arguments(*flags['cflags'], *includes)}"]
    # Each build is a fresh one, so ninja needs no record of the headers; jitk reads the
    # compilers' dependency files itself (_headers_read).
    rules = ["rule compile",
             "  command = $cxx -MMD -MF $out.d $cxxflags -c $in -o $out", ""]
    if any(source.endswith(".cu") for source in spec.sources):
        cuda_cflags = ["-ccbin", toolchain.nvcc_host_compiler(), *gencode_flags(spec.archs),
                       *flags["cuda_cflags"], *includes]
        lines += [f"nvcc = {_arguments(toolchain.nvcc_path())}",
                  f"cuda_cflags = {_arguments(*cuda_cflags)}"]
        rules += ["rule compile_cuda",
                  "  command = $nvcc --generate-dependencies-with-compile --dependency-output "
                  "$out.d $cuda_cflags -c $in -o $out", ""]
    if HOST_HALF in spec.sources:  # the first unit of every host half
        half = [*host_half_flags(spec.archs, flags["include_dirs"]),
                *(prelude.flags() if prelude else [])]
        lines.append(f"host_half_flags = {_arguments(*half)}")
        rules += ["rule compile_host_half",
                  "  command = $cxx -MMD -MF $out.d $host_half_flags -c $in -o $out", ""]
    if spec.archs:
        ldflags += toolchain.cudart_link_flags()
    if prelude and HOST_HALF in spec.sources:
        ldflags = [*prelude.link_inputs(), *ldflags]
    lines.append(f"ldflags = {_arguments(*ldflags, *flags['ldflags'])}")
    rules += ["rule link", "  command = $cxx $in $ldflags -o $out", ""]
    objects = {file_name: _object(file_name) for file_name in spec.sources}
    def rule(source: str) -> str:
        if is_host_half(source):
            return "compile_host_half"
        return "compile_cuda" if source.endswith(".cu") else "compile"
    builds = [f"build {obj}: {rule(src)} {src}" for src, obj in objects.items()]
    library = f"{spec.name}.so"
    builds += [f"build {library}: link {' '.join(objects.values())}", f"default {library}"]
    return "\n".join([*lines, "", *rules, *builds, ""])


def _run_ninja(module: str, staging: Path) -> None:
    """Runs ninja in `staging` under the guard; raises JitCompileError when the build fails."""
    timeout = lock_timeout()
    ninja = [toolchain.ninja(), "-v"]
    guarded = [sys.executable or "python3", "-I", str(GUARD), str(os.getpid()), str(timeout),
               *ninja]
    try:  # the guard stops the build at `timeout`; this only bounds a guard gone wrong
        done = subprocess.run(guarded, cwd=staging, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, errors="replace",
                              timeout=timeout + 60, check=False)
    except subprocess.TimeoutExpired as stopped:
        reason = f"jitk: the build guard did not stop the build within {timeout + 60:g} s"
        raise JitCompileError(module, shlex.join(guarded), [reason], str(stopped)) from None
    if done.returncode != 0:
        raise compile_error(module, done.stdout, staging, ninja)


def _covered_by_key(spec: BuildSpec, staging: Path) -> tuple[str, ...]:
    """Folders whose headers the cache key covers by a version in it (tvm-ffi's, the CUDA
    toolkit's, the host compiler's), and the build folder (its sources are in the key), as
    path prefixes, both as given and with links resolved."""
    roots = [staging, Path(find_include_path()), Path(find_dlpack_include_path()),
             cache.cache_root() / pch.FOLDER]  # a prelude's own file: its key covers it
    # nvcc's, where nvcc builds; a host half is the host compiler's alone
    for compiler in toolchain.compilers(cuda=bool(spec.archs) and not spec.device_halves):
        roots += toolchain.system_include_dirs(compiler)
    if spec.archs:
        roots.append(toolchain.cuda_home())
    spellings = {os.path.normpath(p) for root in roots for p in (root, os.path.realpath(root))}
    return tuple(spelling.rstrip(os.sep) + os.sep for spelling in spellings)


def _headers_read(staging: Path, sources: dict[str, str]) -> list[str]:
    """The files each compiler read: NVRTC's list, and the make-style dependency file each
    other compiler wrote beside its object (and for a host half, the precompiled prelude's,
    copied beside it): a backslash escapes a space or '#'; gcc doubles '$', nvcc does not."""
    device_half = staging / DEVICE_HEADERS  # NVRTC's, one a line (device_halves.build)
    paths = device_half.read_text().splitlines() if device_half.is_file() else []
    depfiles = [(source, staging / f"{_object(source)}.d") for source in sources]
    prelude = staging / f"{_object(HOST_HALF)}.prelude.d"
    if prelude.is_file():
        depfiles.append((HOST_HALF, prelude))
    for source, depfile in depfiles:
        text = depfile.read_text().replace("\\\n", " ")
        words = re.findall(r"(?:\\.|[^\s\\])+", text.partition(":")[2])
        for word in words:
            path = re.sub(r"\\([ #])", r"\1", word)
            paths.append(path if source.endswith(".cu") else path.replace("$$", "$"))
    return paths


def package_headers(spec: BuildSpec, staging: Path) -> dict[str, str]:
    """Digests of the headers the build read that no version in the key covers: jitk's own,
    a kernel family's and those in the user's include paths. An entry records them and a
    lookup checks them (cache.look_up), so an edit rebuilds exactly the entries whose builds
    read the header."""
    covered = _covered_by_key(spec, staging)
    listed = {os.path.realpath(path) for path in spec.kernel_files}
    headers = {}
    for read in _headers_read(staging, spec.sources):
        path = os.path.normpath(staging / read)  # the sources are named relative to it
        if not path.startswith(covered) and os.path.realpath(path) not in listed:
            headers[cache.portable(path)] = cache.digest(Path(path))
    return dict(sorted(headers.items()))


# What a build's time went to, seconds each (jitk.jit_stats()'s events show them):
# "compilers", what ninja ran (the host compiler for a host half, else nvcc and the host
# compiler); "nvrtc", the device halves compiled in the process (with any wait for the device
# prelude); "publish", the copy into the cache, its check and load, and the rename.
PHASES = ("compilers", "nvrtc", "publish")


@dataclass(frozen=True)
class Built:
    module: tvm_ffi.Module
    phases: dict[str, float]  # PHASES -> seconds; "nvrtc" only where NVRTC built


def build_and_publish(spec: BuildSpec) -> Built:
    """Builds `spec` in a fresh folder on this host, copies it onto the cache's file system,
    loads it from there, publishes it as `spec.entry` and returns the loaded module with the
    seconds of each phase. A failed build raises JitCompileError and leaves its folder for
    inspection until the next build of the same entry."""
    for stale in old_stagings(spec.entry):  # we hold the lock: their builders are gone
        shutil.rmtree(stale, ignore_errors=True)
    staging = new_staging(spec.entry)
    for file_name, text in spec.sources.items():
        (staging / file_name).write_text(text)
    prelude = None
    if HOST_HALF in spec.sources:
        prelude = _prelude(spec.archs)
        if prelude:  # what it read is what the host half read (package_headers)
            shutil.copyfile(prelude.depfile, staging / f"{_object(HOST_HALF)}.prelude.d")
    (staging / "build.ninja").write_text(build_file(spec, prelude))
    started = time.perf_counter()
    options = device_halves.options(spec)
    for arch_options in options.values():  # made beside the host compile
        device_prelude.start(arch_options)
    early = device_halves.start_early(spec, options)
    _run_ninja(spec.name, staging)
    compiled = time.perf_counter()
    library = staging / f"{spec.name}.so"
    device_code = device_halves.build(spec, staging, options, early) if options else {}
    built = time.perf_counter()
    seconds = built - started
    sha256 = cache.digest(library)
    cache.write_meta(staging, {
        "module": spec.name, "key": spec.key, "library": library.name,
        "archs": list(spec.archs), "build_seconds": round(seconds, 3), "built_at": time.time(),
        "sha256": sha256, "headers": package_headers(spec, staging),
        "device_code": {name: cache.digest_bytes(data) for name, data in device_code.items()}})
    private = cache.copy_in(staging, spec.entry, spec.in_place)
    shutil.rmtree(staging)
    try:  # before publication: it cannot vanish, and a library that does not load stays out
        module = _load_copy(private / library.name, sha256, device_code)
    except Exception as error:
        shutil.rmtree(private, ignore_errors=True)
        raise JitCompileError(spec.name, f"dlopen {private / library.name}", [str(error)],
                              str(error)) from None
    if spec.in_place:
        cache.publish_in_place(private, spec.entry)
    else:
        cache.publish(private, spec.entry, spec.key)
    logger.info("jitk: built %s for %s in %.2f s (%s)", spec.name,
                ", ".join(toolchain.sm_name(a) for a in spec.archs) or "host only", seconds,
                spec.entry)
    phases = {"compilers": compiled - started, "nvrtc": built - compiled,
              "publish": time.perf_counter() - built}
    return Built(module, {name: phases[name] for name in PHASES
                          if name != "nvrtc" or options})


def _load_copy(library: Path, sha256: str, device_code: dict[str, bytes]) -> tvm_ffi.Module:
    """Loads the copied library from the descriptor that shows it is the one built."""
    fd = os.open(library, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    if cache.digest_fd(fd) != sha256:
        os.close(fd)
        raise OSError(f"{library} differs from the library built (copied wrongly)")
    return loader.load_from_fd(fd, device_code)
