"""The build toolchain, each program found once and named by its path: ninja, the
compilers in use (their versions are part of every cache key), where the CUDA toolkit is,
and which GPU architectures to build for."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ARCH_ENV = "JITK_CUDA_ARCH"
_ARCH_PATTERN = re.compile(r"^(\d+)\.(\d+)([af]?)$")


class ToolchainError(RuntimeError):
    """The CUDA toolkit, a compiler or the target architecture could not be determined."""


def _is_cuda_root(path: Path) -> bool:
    return (path / "include" / "cuda_runtime.h").is_file() and (path / "bin" / "nvcc").exists()


def _root_reported_by_nvcc(nvcc: str) -> Path | None:
    # nvcc on PATH may be a wrapper script in another folder; nvcc itself knows its root.
    try:
        out = subprocess.run(
            [nvcc, "-dryrun", "-E", "-x", "cu", os.devnull],
            capture_output=True, text=True, timeout=60, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    for line in (out.stdout + out.stderr).splitlines():
        if line.startswith("#$ TOP="):
            return Path(line.split("=", 1)[1].strip()).resolve()  # TOP is <root>/bin/..
    return None


@functools.cache
def cuda_home() -> Path:
    """The CUDA toolkit root: $CUDA_HOME or $CUDA_PATH, else the one nvcc on PATH belongs to,
    else /usr/local/cuda. Raises ToolchainError saying what was tried."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value:
            if not _is_cuda_root(Path(value)):
                raise ToolchainError(
                    f"${var}={value} is not a CUDA toolkit (no bin/nvcc and "
                    "include/cuda_runtime.h there); point it at the toolkit root"
                )
            return Path(value)
    tried = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        for candidate in (Path(nvcc).resolve().parent.parent, _root_reported_by_nvcc(nvcc)):
            if candidate is not None and _is_cuda_root(candidate):
                return candidate
            tried.append(str(candidate))
    default = Path("/usr/local/cuda")
    if _is_cuda_root(default):
        return default
    tried.append(str(default))
    raise ToolchainError(
        "jitk could not find the CUDA toolkit (looked for nvcc on PATH and at "
        f"{', '.join(tried)}); install it or set CUDA_HOME to its root"
    )


def parse_archs(text: str) -> tuple[str, ...]:
    """'9.0a;8.0' -> ('9.0a', '8.0'). Separators: ';', ',' or spaces."""
    archs = tuple(a for a in re.split(r"[;,\s]+", text.strip()) if a)
    bad = [a for a in archs if not _ARCH_PATTERN.match(a)]
    if bad or not archs:
        raise ToolchainError(
            f"{ARCH_ENV}={text!r} is not a list of compute capabilities such as '9.0' or "
            f"'9.0a;8.0' (bad: {bad or 'empty'})"
        )
    return archs


def current_gpu_capability() -> tuple[int, int] | None:
    """The compute capability of PyTorch's current CUDA device, or None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def target_archs() -> tuple[str, ...]:
    """$JITK_CUDA_ARCH if set, else the current GPU's architecture."""
    if os.environ.get(ARCH_ENV):
        return parse_archs(os.environ[ARCH_ENV])
    capability = current_gpu_capability()
    if capability is None:
        raise ToolchainError(
            f"no CUDA GPU is visible, so jitk cannot pick an architecture to build for; "
            f"set {ARCH_ENV} (for example {ARCH_ENV}=9.0) to build without a GPU"
        )
    # Plain sm_XY, so that a cache filled ahead of time with JITK_CUDA_ARCH=X.Y is hit.
    return (f"{capability[0]}.{capability[1]}",)


def sm_name(arch: str) -> str:
    return "sm_" + arch.replace(".", "")


def runs_on(archs: tuple[str, ...], capability: tuple[int, int]) -> bool:
    """Whether machine code built for `archs` runs on a GPU of `capability`.

    jitk embeds machine code only (no PTX): plain sm_XY code runs on the same major
    version with an equal or newer minor; 'a' code runs on exactly that GPU, 'f' code on
    the same major version."""
    for arch in archs:
        major, minor, suffix = _ARCH_PATTERN.match(arch).groups()  # type: ignore[union-attr]
        major, minor = int(major), int(minor)
        if suffix == "a" and (major, minor) == capability:
            return True
        if suffix in ("", "f") and major == capability[0] and minor <= capability[1]:
            return True
    return False


def check_runs_on_current_gpu(module: str, archs: tuple[str, ...]) -> None:
    """Fail at load, naming both architectures, rather than at the first launch with
    'no kernel image is available'."""
    capability = current_gpu_capability()
    if capability is None or runs_on(archs, capability):
        return
    import torch

    device = torch.cuda.current_device()
    raise ToolchainError(
        f"jitk module '{module}' holds code for {', '.join(sm_name(a) for a in archs)}, "
        f"but the current GPU (cuda:{device}, {torch.cuda.get_device_name(device)}) is "
        f"sm_{capability[0]}{capability[1]}; unset {ARCH_ENV} or add "
        f"{capability[0]}.{capability[1]} to it"
    )


def _run(command: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as error:
        raise ToolchainError(f"cannot run {command[0]}: {error}") from error


@functools.cache
def _located(program: str, setting: str) -> str:
    """The absolute path of `program` (a name on PATH or a path), looked up once. Links are
    kept: ccache, for one, tells compilers apart by the name it is started as."""
    found = shutil.which(program)
    if found is None:
        raise ToolchainError(f"jitk cannot find {program!r} ({setting}): not an executable "
                             f"file or a program on PATH; install it or set {setting}")
    return os.path.abspath(found)


@functools.cache
def ninja() -> str:
    """The ninja that runs builds: the one on PATH, else the one beside this Python (pip's)."""
    found = shutil.which("ninja") or shutil.which("ninja", path=os.path.dirname(sys.executable))
    if found is None:
        raise ToolchainError("jitk builds with ninja, which is neither on PATH nor beside "
                             f"{sys.executable} (pip install ninja)")
    return os.path.abspath(found)


def host_compiler() -> str:
    """The compiler of C++ sources and of the link: $CXX, else c++."""
    return _located(os.environ.get("CXX") or "c++", "CXX")


def nvcc_host_compiler() -> str:
    """The compiler nvcc runs for the host half of CUDA sources, given to it as -ccbin:
    $NVCC_CCBIN (a compiler or its folder, as nvcc takes it), else gcc, nvcc's own default."""
    chosen = os.environ.get("NVCC_CCBIN") or "gcc"
    if os.path.isdir(chosen):
        chosen = os.path.join(chosen, "gcc")
    return _located(chosen, "NVCC_CCBIN")


def compilers(cuda: bool) -> list[str]:
    """The compilers a build runs: $CXX (C++ sources and the link), and for CUDA sources
    nvcc and its host compiler. Their versions are part of the cache key."""
    if cuda:
        return [host_compiler(), nvcc_path(), nvcc_host_compiler()]
    return [host_compiler()]


_versions: dict[str, str] = {}


def _version_line(compiler: str, query: subprocess.Popen) -> str:
    try:
        out, err = query.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        query.kill()
        out, err = query.communicate()
    lines = [line for line in out.splitlines() if line.strip()]
    if query.returncode != 0 or not lines:
        raise ToolchainError(f"'{compiler} --version' failed (exit {query.returncode}): "
                             f"{err.strip()[-500:]}")
    return lines[-1] if "nvcc" in compiler else lines[0]  # nvcc says its release last


def compiler_versions(compilers: list[str]) -> list[str]:
    """The version line of each compiler (part of every cache key). The ones not asked yet
    are asked side by side: each query is a few milliseconds of a warm load."""
    asking: dict[str, subprocess.Popen] = {}
    failure = None
    for compiler in dict.fromkeys(c for c in compilers if c not in _versions):
        try:
            asking[compiler] = subprocess.Popen([compiler, "--version"], text=True,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as error:
            failure = ToolchainError(f"cannot run {compiler}: {error.strerror}")
            break
    for compiler, query in asking.items():  # every started query is answered and reaped
        _versions[compiler] = _version_line(compiler, query)
    if failure:
        raise failure
    return [_versions[c] for c in compilers]


def nvcc_path() -> str:
    """The nvcc that builds run: $CUDA_HOME's (or $CUDA_PATH's), else the one on PATH, else
    /usr/local/cuda's. Cheaper than cuda_home(), which may have to ask a wrapper script."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return str(cuda_home() / "bin" / "nvcc")
    return shutil.which("nvcc") or str(cuda_home() / "bin" / "nvcc")


@functools.cache
def _supported_archs(nvcc: str) -> tuple[str, ...]:
    out = _run([nvcc, "--list-gpu-arch"])
    found = re.findall(r"^compute_(\d+)(\d)$", out.stdout, re.MULTILINE)
    if out.returncode != 0 or not found:
        raise ToolchainError(f"'{nvcc} --list-gpu-arch' failed: {out.stderr.strip()}")
    return tuple(f"{major}.{minor}" for major, minor in found)


def supported_archs() -> tuple[str, ...]:
    """The compute capabilities the installed nvcc can build for ('7.5', ..., '12.1')."""
    return _supported_archs(nvcc_path())


def check_buildable(archs: tuple[str, ...]) -> None:
    """Refuses, before any build, an architecture the installed nvcc cannot target."""
    supported = supported_archs()
    bad = [a for a in archs if a.rstrip("af") not in supported]
    if bad:
        raise ToolchainError(
            f"the installed nvcc ({nvcc_path()}) cannot build for "
            f"{', '.join(sm_name(a) for a in bad)}; it supports compute capabilities "
            f"{', '.join(supported)} (set {ARCH_ENV}, or precompile's --arch, to those)")


@functools.cache
def system_include_dirs(compiler: str) -> tuple[Path, ...]:
    """A host compiler's own include directories (their headers change with its version,
    which is part of every cache key)."""
    lines = _run([compiler, "-x", "c++", "-E", "-v", os.devnull]).stderr.splitlines()
    try:
        first = lines.index("#include <...> search starts here:") + 1
        last = lines.index("End of search list.", first)
    except ValueError:
        return ()
    return tuple(Path(line.strip()).resolve() for line in lines[first:last])
