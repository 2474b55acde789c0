"""NVRTC in the process: CUDA device code to a cubin without nvcc, for the kernels of files
written in two halves (jitk/nvrtc.cuh; load_jit(..., cuda_compiler="nvrtc"), builder.py).

The library comes from the nvidia-cuda-nvrtc wheel (nvidia/cu13/lib, pinned by the `nvrtc`
extra to the CUDA line of the nvcc and runtime jitk builds with), else from the dynamic
loader's path. Template instantiations are named as NVRTC name expressions ("&ns::k<float>");
`compile_cubin` returns each one's lowered (mangled) name, which the host side looks the
kernel up by in the loaded cubin."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from jitk.base import settings
from jitk.base.errors import ArgumentError, JitkError
from jitk.build import toolchain

__all__ = ["OPTIONS", "PRELUDE", "NvrtcError", "Program", "builds_here", "choose",
           "compile_cubin", "create_pch", "installed", "kernel_names", "library_path",
           "preferred", "version"]

_SONAME = "libnvrtc.so.13"
# What every build of a device half passes, besides its architecture and include folders.
# -default-device: a function without an execution space is a device function, as nvcc's
# --expt-relaxed-constexpr lets device code call constexpr ones (NVRTC refuses host functions).
# -split-compile=0: NVVM optimises the kernels on as many threads as there are cores, which
# emits the same instructions in another order (tests/test_device_prelude.py).
OPTIONS = ("-std=c++20", "-default-device", "-split-compile=0")
# What a device half's source reads first: the headers every device half shares, which a
# build loads precompiled (create_pch; jitk/build/device_prelude.py) or else parses.
PRELUDE = "#include <jitk/device_prelude.cuh>\n"
_SUCCESS = 0


class NvrtcError(JitkError, RuntimeError):
    """NVRTC could not be loaded, or refused a program (its log is in the message)."""


@functools.cache
def library_path() -> str:
    """The libnvrtc a build loads: the nvidia-cuda-nvrtc wheel's, else the loader's own."""
    for folder in sys.path:
        candidate = Path(folder or ".", toolchain.WHEEL_ROOT, "lib", _SONAME)
        if candidate.is_file():
            return str(candidate)
    return _SONAME


@functools.cache
def _lib() -> ctypes.CDLL:
    try:
        # libnvrtc opens its builtins by name at the first compile; the wheel's folder is not
        # on the loader's path, so they are loaded here first from beside it.
        for builtins in sorted(Path(library_path()).parent.glob("libnvrtc-builtins.so.*")):
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
        lib = ctypes.CDLL(library_path())
    except OSError as error:
        raise NvrtcError(f"NVRTC: could not load {library_path()} "
                         f"({error}); pip install 'jitk[nvrtc]' for the CUDA 13.0 line") from None
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def _check(result: int, call: str, log: str = "") -> None:
    if result != _SUCCESS:
        what = _lib().nvrtcGetErrorString(result).decode()
        raise NvrtcError(f"NVRTC {call} failed: {what}" + (f"\n{log}" if log else ""))


@functools.cache
def version() -> tuple[int, int]:
    """NVRTC's major and minor version, part of every key it builds. Beside a library found by
    path, it is the builtins library's (libnvrtc-builtins.so.<major>.<minor>, which libnvrtc
    opens by its own version), so a warm load opens no library; compile_cubin checks that
    libnvrtc agrees."""
    if Path(library_path()).is_absolute():
        found = [re.fullmatch(r"libnvrtc-builtins\.so\.(\d+)\.(\d+)", path.name)
                 for path in Path(library_path()).parent.iterdir()]
        found = {(int(match[1]), int(match[2])) for match in found if match}
        if len(found) == 1:
            return found.pop()
    return _loaded_version()


@functools.cache
def _loaded_version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(_lib().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


@dataclass(frozen=True)
class Program:
    cubin: bytes
    lowered: dict[str, str]  # name expression -> the kernel's mangled name in the cubin
    log: str
    ptx: bytes  # what the cubin was made from, with its terminating NUL
    headers: tuple[str, ...]  # the files NVRTC read, less those a precompiled header held
    used_pch: bool  # whether NVRTC loaded the precompiled header it was given


def _text(getter: str, size_getter: str, handle: ctypes.c_void_p) -> bytes:
    size = ctypes.c_size_t()
    _check(getattr(_lib(), size_getter)(handle, ctypes.byref(size)), size_getter)
    buffer = ctypes.create_string_buffer(size.value)
    _check(getattr(_lib(), getter)(handle, buffer), getter)
    return buffer.raw[:size.value]


# NVRTC's log lines saying that it made or used a precompiled header (--pch-messages).
_PCH_MESSAGE = re.compile(r'^"[^"\n]*": (creating|using) precompiled header file .*\n?',
                          re.MULTILINE)


@contextlib.contextmanager
def _compiled(source: str, name: str, expressions: list[str], options: list[str],
              folder: Path | None) -> Iterator[tuple[ctypes.c_void_p, str, tuple[str, ...], bool]]:
    """Compiles `source` and yields the program, its log, the files NVRTC read and whether
    it loaded the precompiled header it was given (--use-pch). NVRTC has no dependency file:
    its time trace (--fdevice-time-trace, to a fresh file each compile, in `folder` or a
    temporary one, as the assembler appends to one that exists) names each header it
    processed. The trace and the PCH messages are in every compile's options, as NVRTC takes
    a precompiled header only from a compile whose options match its own."""
    lib = _lib()
    if _loaded_version() != version():
        raise NvrtcError(f"NVRTC: {library_path()} is version {_loaded_version()}, but its "
                         f"builtins beside it are {version()}; reinstall nvidia-cuda-nvrtc")
    handle = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(handle), source.encode(), name.encode(), 0,
                                  None, None), "nvrtcCreateProgram")
    try:
        with _trace_file(name, folder) as trace:
            for expression in expressions:
                _check(lib.nvrtcAddNameExpression(handle, expression.encode()),
                       f"nvrtcAddNameExpression({expression!r})")
            encoded = [option.encode() for option in (
                *options, f"--fdevice-time-trace={trace}", "--pch-messages=true")]
            argv = (ctypes.c_char_p * len(encoded))(*encoded)
            result = lib.nvrtcCompileProgram(handle, len(encoded), argv)
            log = _text("nvrtcGetProgramLog", "nvrtcGetProgramLogSize", handle)
            log = log.rstrip(b"\0").decode(errors="replace").strip()
            used_pch = "using precompiled header file" in log
            log = _PCH_MESSAGE.sub("", log).strip()  # a note, not a warning
            _check(result, f"compiling {name}", log)
            headers = _headers_in(trace.with_name(f"{trace.name}.json"), name)
        yield handle, log, headers, used_pch
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(handle))


@contextlib.contextmanager
def _trace_file(name: str, folder: Path | None) -> Iterator[Path]:
    """Where one compile's time trace goes: a file of its own in `folder`, or in a fresh
    temporary folder; removed after."""
    if folder is not None:
        handle, name_made = tempfile.mkstemp(prefix="nvrtc-", suffix=".trace", dir=folder)
        os.close(handle)
        trace = Path(name_made)
        try:
            yield trace
        finally:  # the name was made here, and NVRTC writes the trace beside it (.json)
            trace.unlink(missing_ok=True)
            trace.with_name(f"{trace.name}.json").unlink(missing_ok=True)
        return
    try:
        made = tempfile.TemporaryDirectory(prefix="jitk-nvrtc-")
    except OSError as error:
        raise NvrtcError(f"NVRTC cannot compile {name} without a folder for the record of "
                         f"the headers it reads: {error}") from None
    with made as path:
        yield Path(path, "trace")


def _headers_in(trace: Path, name: str) -> tuple[str, ...]:
    """The files a time trace says NVRTC processed (its built-in headers have no path)."""
    try:
        events = json.loads(trace.read_text())["traceEvents"]
        found = {event["args"]["detail"] for event in events
                 if event.get("name") == "Processing Header File"}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise NvrtcError(f"NVRTC compiled {name} but its record of the headers it read "
                         f"({trace.name}) cannot be read: {error}") from None
    return tuple(sorted(path for path in found if os.path.isabs(path)))


def compile_cubin(source: str, name: str, expressions: list[str], options: list[str],
                  pch: Path | None = None, folder: Path | None = None) -> Program:
    """Compiles `source` (named `name` in messages) with `options` (an -arch=sm_XX among
    them, for a cubin) and returns the cubin and each name expression's lowered name. `pch`:
    a precompiled header that create_pch made with the same options, for the source's first
    #include (NVRTC parses the header instead where it does not match). `folder`: where the
    compile may write a file while it runs (a build's own folder), else a temporary one."""
    if not any(option.startswith(("-arch=sm_", "--gpu-architecture=sm_")) for option in options):
        raise ArgumentError(f"compile_cubin(options=...): a cubin needs a real architecture, "
                            f"e.g. -arch=sm_90; got {options}")
    used = [*options, *([f"--use-pch={pch}"] if pch else [])]
    with _compiled(source, name, expressions, used, folder) as (handle, log, headers,
                                                                 used_pch):
        lowered = {}
        for expression in expressions:
            mangled = ctypes.c_char_p()
            _check(_lib().nvrtcGetLoweredName(handle, expression.encode(),
                                              ctypes.byref(mangled)),
                   f"nvrtcGetLoweredName({expression!r})")
            lowered[expression] = mangled.value.decode()
        cubin = _text("nvrtcGetCUBIN", "nvrtcGetCUBINSize", handle)
        ptx = _text("nvrtcGetPTX", "nvrtcGetPTXSize", handle)
    return Program(cubin, lowered, log, ptx, headers, used_pch)


def create_pch(path: Path, header: str, options: list[str]) -> tuple[str, ...]:
    """Precompiles `header` (an #include line) for compiles with `options` into `path`, and
    returns the files it read. The precompiled part of a source is its leading directives:
    a declaration after the include ends it, so the header alone is in the file."""
    with _compiled(f"{header}namespace jitk {{}}\n", path.name, [],
                   [*options, f"--create-pch={path}"], path.parent) as (handle, log, headers, _):
        status = _lib().nvrtcGetPCHCreateStatus(handle)
    if status != _SUCCESS or not path.is_file():
        what = _lib().nvrtcGetErrorString(status).decode()
        raise NvrtcError(f"NVRTC did not precompile {header.strip()}: {what}\n{log}")
    return headers


def preferred(requested: str) -> str:
    """What a load_jit(cuda_compiler=requested) call asks for: "nvcc", "nvrtc", or "auto"
    (NVRTC where it builds, see choose), through JITK_CUDA_COMPILER when `requested` is
    "auto"."""
    return settings.get("JITK_CUDA_COMPILER") if requested == "auto" else requested


def choose(requested: str) -> str:
    """The compiler that builds a load_jit(cuda_compiler=requested) call's files written in
    two halves: `preferred`'s answer, with "auto" made NVRTC where its library loads and the
    toolkit has the headers a device half reads (libcu++'s, under include/cccl), else nvcc."""
    wanted = preferred(requested)
    if wanted != "auto":
        return wanted
    return "nvrtc" if builds_here() else "nvcc"


def installed() -> bool:
    """Whether libnvrtc is here with a version to key on, without loading it where the wheel
    installed it (version): what "auto" looks up first, as only a build needs to know that
    NVRTC can build (builds_here)."""
    try:
        version()
    except NvrtcError:
        return False
    return True


@functools.cache
def builds_here() -> bool:
    """Whether NVRTC can build here with the process's toolkit (toolchain.cuda_home, found
    once a process, as this is asked; finding it may run nvcc)."""
    try:
        _lib()
        return (toolchain.cuda_home() / "include" / "cccl" / "cuda" / "std").is_dir()
    except (NvrtcError, toolchain.ToolchainError):
        return False


def kernel_names(library: Path) -> list[str]:
    """The name expressions of the kernels a built host half launches by name (what its
    instantiations of LaunchKernel::launch registered, jitk/nvrtc.cuh), from the library;
    none for a library without jitk/nvrtc.cuh (host code only)."""
    try:
        loaded = ctypes.CDLL(str(library))
    except OSError as error:
        raise NvrtcError(f"cannot read the kernels {library.name} launches: {error}") from None
    names = getattr(loaded, "jitk_nvrtc_kernel_names", None)
    if names is None:
        return []
    names.restype = ctypes.c_char_p
    text = names()
    if text is None:
        raise NvrtcError(f"{library.name} could not list the kernels it launches")
    return text.decode().splitlines()
