"""The build toolchain, each program found once and named by its path: ninja, the
compilers in use (their versions are part of every cache key), where the CUDA toolkit is,
and which GPU architectures to build for."""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from jitk.base.errors import JitkError
from jitk.build import versions

logger = logging.getLogger("jitk")

ARCH_ENV = "JITK_CUDA_ARCH"
_ARCH_PATTERN = re.compile(r"^(\d+)\.(\d+)([af]?)$")


class ToolchainError(JitkError, RuntimeError):
    """The CUDA toolkit, a compiler or the target architecture could not be determined."""


# ------------------------------------------------------------------ the CUDA toolkit
# Where nvcc comes from, first found wins: $JITK_NVCC; $CUDA_HOME (or $CUDA_PATH); the nvcc
# on PATH; the CUDA 13 wheels of `pip install 'jitk[cuda]'`; /usr/local/cuda.
NVCC_ENV = "JITK_NVCC"
ROOT_ENVS = ("CUDA_HOME", "CUDA_PATH")
WHEEL_ROOT = Path("nvidia", "cu13")  # nvidia-cuda-nvcc/-runtime/-crt/-cccl install here
DEFAULT_ROOT = Path("/usr/local/cuda")


def _is_cuda_root(path: Path) -> bool:
    return (path / "include" / "cuda_runtime.h").is_file() and (path / "bin" / "nvcc").exists()


def wheel_root() -> Path | None:
    """The toolkit the nvidia-cuda-* wheels installed (under site-packages), if any."""
    for folder in sys.path:
        root = Path(folder or ".", WHEEL_ROOT)
        if (root / "bin" / "nvcc").is_file():
            return root
    return None


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


def _explicit_nvcc() -> str | None:
    value = os.environ.get(NVCC_ENV)
    if value and not (os.path.isfile(value) and os.access(value, os.X_OK)):
        raise ToolchainError(f"${NVCC_ENV}={value} is not an executable file; point it at nvcc")
    return value or None


def _root_env() -> tuple[str, Path] | None:
    """$CUDA_HOME or $CUDA_PATH, checked, when set."""
    for var in ROOT_ENVS:
        value = os.environ.get(var)
        if value:
            if not _is_cuda_root(Path(value)):
                raise ToolchainError(
                    f"${var}={value} is not a CUDA toolkit (no bin/nvcc and "
                    "include/cuda_runtime.h there); point it at the toolkit root"
                )
            return var, Path(value)
    return None


@functools.cache
def cuda_home() -> Path:
    """The root of the toolkit whose nvcc builds run (see find_nvcc()). Raises
    ToolchainError saying what was tried."""
    explicit = _explicit_nvcc()
    if not explicit and (found := _root_env()):
        return found[1]
    tried = []
    nvcc = explicit or shutil.which("nvcc")
    if nvcc:
        for candidate in (Path(nvcc).resolve().parent.parent, _root_reported_by_nvcc(nvcc)):
            if candidate is not None and _is_cuda_root(candidate):
                return candidate
            tried.append(str(candidate))
        if explicit:
            raise ToolchainError(f"${NVCC_ENV}={explicit} belongs to no CUDA toolkit root "
                                 f"(tried {', '.join(tried)}: no include/cuda_runtime.h)")
    for root in (wheel_root(), DEFAULT_ROOT):
        if root is not None and _is_cuda_root(root):
            return root
    tried.append(f"the nvidia-cuda-* wheels, {DEFAULT_ROOT}")
    raise ToolchainError(
        "jitk: could not find the CUDA toolkit (looked for nvcc on PATH and at "
        f"{', '.join(tried)}); install one (pip install 'jitk[cuda]' for CUDA 13), or set "
        "CUDA_HOME to its root"
    )


def find_nvcc() -> tuple[Path, str]:
    """The nvcc that builds run and where it came from: $JITK_NVCC, else $CUDA_HOME's (or
    $CUDA_PATH's), else the one on PATH, else the nvidia-cuda-nvcc wheel's, else
    /usr/local/cuda's. Runs no process (unlike cuda_home() on a wrapper script)."""
    if explicit := _explicit_nvcc():
        return Path(explicit), NVCC_ENV
    if found := _root_env():
        return found[1] / "bin" / "nvcc", found[0]
    if on_path := shutil.which("nvcc"):
        return Path(on_path), "PATH"
    if wheels := wheel_root():
        return wheels / "bin" / "nvcc", "the nvidia-cuda-nvcc wheel"
    return cuda_home() / "bin" / "nvcc", str(DEFAULT_ROOT)


def cudart_link_flags() -> list[str]:
    """The linker's flags for the toolkit's libcudart: lib64/libcudart.so in an installed
    toolkit; the nvidia-cuda-runtime wheel has only lib/libcudart.so.13, named exactly."""
    root = cuda_home()
    if (root / "lib64" / "libcudart.so").exists():
        return [f"-L{root / 'lib64'}", "-lcudart"]
    for library in sorted((root / "lib").glob("libcudart.so.*")):  # the shortest name first
        return [f"-L{library.parent}", f"-l:{library.name}"]
    return [f"-L{root / 'lib64'}", "-lcudart"]  # the linker's error names what is missing


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


def arch_number(arch: str) -> int:
    """'9.0a' -> 900, as nvcc's __CUDA_ARCH__ and __CUDA_ARCH_LIST__ spell it."""
    major, minor, _ = _split(arch)
    return major * 100 + minor * 10


def _split(arch: str) -> tuple[int, int, str]:
    major, minor, suffix = _ARCH_PATTERN.match(arch).groups()  # type: ignore[union-attr]
    return int(major), int(minor), suffix


def canonical_archs(archs: tuple[str, ...]) -> tuple[str, ...]:
    """Each architecture once, oldest first: '9.0;8.0;9.0' and '8.0 9.0' build one entry."""
    return tuple(sorted(set(archs), key=_split))


def archs_tag(archs: tuple[str, ...]) -> str:
    """('8.0', '9.0a') -> 'sm80-90a': the part of an entry's folder name that says what it
    holds (the cache key leaves the architectures out, so that lookups can match sets)."""
    return "sm" + "-".join(arch.replace(".", "") for arch in canonical_archs(archs))


def ptx_arch(archs: tuple[str, ...]) -> str | None:
    """The architecture whose PTX a multi-architecture ("fat") build also embeds: its newest
    generic one, so that a GPU newer than the list still runs the module, compiled by the
    driver. A single-architecture build holds machine code only."""
    listed = canonical_archs(archs)
    generic = [arch for arch in listed if not _split(arch)[2]]
    return generic[-1] if len(listed) > 1 and generic else None


def runs_on(archs: tuple[str, ...], capability: tuple[int, int]) -> bool:
    """Whether machine code built for `archs` runs on a GPU of `capability`: plain sm_XY
    code runs on the same major version with an equal or newer minor; 'a' code on exactly
    that GPU, 'f' code on the same major version. (PTX: see serves().)"""
    for arch in archs:
        major, minor, suffix = _split(arch)
        if suffix == "a" and (major, minor) == capability:
            return True
        if suffix in ("", "f") and major == capability[0] and minor <= capability[1]:
            return True
    return False


def serves(archs: tuple[str, ...], wanted: str) -> str | None:
    """How a module built for `archs` serves a process that targets `wanted`: 'sass'
    (machine code for it), 'ptx' (the embedded PTX, compiled by the driver at load) or
    None. An architecture-specific target ('9.0a', '10.0f') is served only by itself."""
    major, minor, suffix = _split(wanted)
    if suffix:
        return "sass" if wanted in archs else None
    if runs_on(archs, (major, minor)):
        return "sass"
    ptx = ptx_arch(archs)
    if ptx is not None and _split(ptx)[:2] <= (major, minor):
        return "ptx"
    return None


_ptx_noted: list[str] = []  # the first module this process runs through PTX


def _note_ptx(module: str, ptx: str, capability: tuple[int, int]) -> None:
    if _ptx_noted:
        return
    _ptx_noted.append(module)
    logger.warning("jitk: module '%s' has no machine code for sm_%d%d; the driver compiles "
                   "its compute_%s PTX when it loads (so may other modules; noted once). Add "
                   "%d.%d to %s, or to precompile's --arch, for machine code", module,
                   *capability, ptx.replace(".", ""), *capability, ARCH_ENV)


def check_runs_on_current_gpu(module: str, archs: tuple[str, ...]) -> None:
    """Fail at load, naming both architectures, rather than at the first launch with
    'no kernel image is available'. Code that runs only through PTX says so, once."""
    capability = current_gpu_capability()
    if capability is None or runs_on(archs, capability):
        return
    if serves(archs, f"{capability[0]}.{capability[1]}") == "ptx":
        _note_ptx(module, ptx_arch(archs), capability)
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
        raise ToolchainError(f"jitk: cannot find {program!r} ({setting}): not an executable "
                             f"file or a program on PATH; install it or set {setting}")
    return os.path.abspath(found)


@functools.cache
def ninja() -> str:
    """The ninja that runs builds: the one on PATH, else the one beside this Python (pip's)."""
    found = shutil.which("ninja") or shutil.which("ninja", path=os.path.dirname(sys.executable))
    if found is None:
        raise ToolchainError("jitk: builds with ninja, which is neither on PATH nor beside "
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
    """The version line of each compiler (part of every cache key): as the cache remembers
    it (versions.py), else asked, the ones not asked yet side by side."""
    asking: dict[str, subprocess.Popen] = {}
    failure = None
    for compiler in dict.fromkeys(c for c in compilers if c not in _versions):
        if (line := versions.remembered(compiler)) is not None:
            _versions[compiler] = line
            continue
        try:
            asking[compiler] = subprocess.Popen([compiler, "--version"], text=True,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as error:
            failure = ToolchainError(f"cannot run {compiler}: {error.strerror}")
            break
    for compiler, query in asking.items():  # every started query is answered and reaped
        _versions[compiler] = _version_line(compiler, query)
        versions.remember(compiler, _versions[compiler])
    if failure:
        raise failure
    return [_versions[c] for c in compilers]


def nvcc_path() -> str:
    return str(find_nvcc()[0])


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


def check_min_arch(module: str, archs: tuple[str, ...], min_arch: str) -> None:
    """Refuses, before any build, to build `module` for an architecture older than the
    oldest it supports."""
    too_old = [arch for arch in archs if _split(arch)[:2] < _split(min_arch)[:2]]
    if too_old:
        raise ToolchainError(
            f"jitk module '{module}' cannot be built for "
            f"{', '.join(sm_name(a) for a in too_old)}: it needs {sm_name(min_arch)} or newer "
            f"(drop those from {ARCH_ENV} or precompile's --arch)")


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
