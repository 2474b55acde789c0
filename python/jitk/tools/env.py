"""`python -m jitk env`: what jitk runs with, the first thing to paste into a bug report.

collect() returns the same keys on every machine (KEYS; a value that cannot be found is
None, with the reason under "error"), so that `--json` can be read by scripts."""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import sys
from collections.abc import Callable

from jitk.base import __version__, settings
from jitk.build import cache, nvrtc, remote, toolchain

KEYS = ("jitk", "python", "torch", "tvm_ffi", "nvcc", "nvrtc", "host_compiler",
        "nvcc_host_compiler", "driver", "gpus", "target_archs", "cache", "remote_cache",
        "settings")
NVCC_KEYS = ("path", "source", "version", "toolkit", "error")
NVRTC_KEYS = ("path", "version", "error", "auto_builds_with")
COMPILER_KEYS = ("path", "source", "version", "error")
GPU_KEYS = ("index", "name", "capability", "sm_count")
TARGET_KEYS = ("archs", "source", "error")
CACHE_KEYS = ("dir", "entries", "bytes")


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvcc() -> dict:
    found = dict.fromkeys(NVCC_KEYS)
    try:
        path, found["source"] = toolchain.find_nvcc()
        found["path"] = str(path)
        found["version"] = toolchain.compiler_versions([str(path)])[0]
        found["toolkit"] = str(toolchain.cuda_home())
    except toolchain.ToolchainError as error:
        found["error"] = str(error)
    return found


def _nvrtc() -> dict:
    """NVRTC, which compiles device code in the process where it is installed (the `cuda`
    and `nvrtc` extras): the kernels of files written in two halves (jitk/nvrtc.cuh), built
    with load_jit(..., cuda_compiler="nvrtc"), and with "auto" (every shipped kernel, the
    guide's axpy) as `auto_builds_with` says."""
    found = dict.fromkeys(NVRTC_KEYS)
    found["auto_builds_with"] = nvrtc.choose("auto")
    try:
        found["version"] = "{}.{}".format(*nvrtc.version())
        found["path"] = nvrtc.library_path()
    except nvrtc.NvrtcError as error:
        found["error"] = str(error)
    return found


def _compiler(locate: Callable[[], str], setting: str, default: str) -> dict:
    """A host compiler: the one for C++ sources and the link ($CXX), or the one nvcc runs
    for CUDA sources' host code ($NVCC_CCBIN)."""
    found = dict.fromkeys(COMPILER_KEYS)
    found["source"] = setting if os.environ.get(setting) else f"default: {default} on PATH"
    try:
        found["path"] = locate()
        found["version"] = toolchain.compiler_versions([found["path"]])[0]
    except toolchain.ToolchainError as error:
        found["error"] = str(error)
    return found


def _driver() -> str | None:
    """The CUDA driver's version ('13.0'), asked of libcuda without initialising it."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int()
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def _gpus() -> list[dict]:
    import torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append({"index": index, "name": props.name,
                     "capability": f"{props.major}.{props.minor}",
                     "sm_count": props.multi_processor_count})
    return gpus


def _target_archs() -> dict:
    found = dict.fromkeys(TARGET_KEYS)
    try:
        found["archs"] = list(toolchain.canonical_archs(toolchain.target_archs()))
        found["source"] = toolchain.ARCH_ENV if os.environ.get(toolchain.ARCH_ENV) else "GPU"
    except toolchain.ToolchainError as error:
        found["error"] = str(error)
    return found


def _cache() -> dict:
    entries = cache.list_entries()
    return {"dir": str(cache.cache_root()), "entries": len(entries),
            "bytes": sum(entry.size_bytes for entry in entries)}


def collect() -> dict:
    return {
        "jitk": __version__,
        "python": sys.version.split()[0],
        "torch": _installed("torch"),
        "tvm_ffi": _installed("apache-tvm-ffi"),
        "nvcc": _nvcc(),
        "nvrtc": _nvrtc(),
        "host_compiler": _compiler(toolchain.host_compiler, "CXX", "c++"),
        "nvcc_host_compiler": _compiler(toolchain.nvcc_host_compiler, "NVCC_CCBIN", "gcc"),
        "driver": _driver(),
        "gpus": _gpus(),
        "target_archs": _target_archs(),
        "cache": _cache(),
        "remote_cache": remote.describe(),
        "settings": {name: value for name, value in sorted(os.environ.items())
                     if name.startswith("JITK_")},
    }


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"


def _compiler_line(found: dict) -> str:
    return f"{found['path']} ({found['source']}), " \
        f"{found['version'] or 'error: ' + str(found['error'])}"


def _remote_line(found: dict) -> str:
    error = f"; error: {found['error']}" if found["error"] else ""
    if not found["remote"]:
        return "off (JITK_REMOTE_CACHE unset)" + error
    trusted = ", ".join(found["trusted"]) or "no key, so it pulls nothing"
    return (f"{found['remote']} ({found['url']}), {found['reachable']}; signs with "
            f"{found['signing_key'] or 'no key'}; trusts {trusted}{error}")


def render(report: dict) -> str:
    """The report as lines of `name: value`."""
    nvcc, found_nvrtc, target = report["nvcc"], report["nvrtc"], report["target_archs"]
    gpus = [f"cuda:{g['index']} {g['name']} (sm_{g['capability'].replace('.', '')}, "
            f"{g['sm_count']} SMs)" for g in report["gpus"]]
    archs = (f"{', '.join(toolchain.sm_name(a) for a in target['archs'])} "
             f"({target['source']})" if target["archs"] else f"error: {target['error']}")
    rows = [
        ("jitk", report["jitk"]), ("python", report["python"]),
        ("torch", report["torch"] or "not installed"),
        ("apache-tvm-ffi", report["tvm_ffi"] or "not installed"),
        ("nvcc", f"{nvcc['path']} ({nvcc['source']}), {nvcc['version']}; toolkit "
                 f"{nvcc['toolkit']}" if not nvcc["error"] else f"error: {nvcc['error']}"),
        ("nvrtc", f"{found_nvrtc['path']}, {found_nvrtc['version']}"
                  if not found_nvrtc["error"] else f"not found: {found_nvrtc['error']}"),
        ("two-halves files build with", f"{found_nvrtc['auto_builds_with']} "
                                        "(cuda_compiler='auto'; JITK_CUDA_COMPILER)"),
        ("host compiler", _compiler_line(report["host_compiler"])),
        ("nvcc's host compiler", _compiler_line(report["nvcc_host_compiler"])),
        ("driver", report["driver"] or "none found"),
        ("GPUs", "; ".join(gpus) or "none visible"),
        ("builds for", archs),
        ("cache", f"{report['cache']['dir']}: {report['cache']['entries']} entries, "
                  f"{_mib(report['cache']['bytes'])}"),
        ("remote cache", _remote_line(report["remote_cache"])),
        ("settings", ", ".join(f"{k}={v}" for k, v in report["settings"].items()) or "none"),
    ]
    width = max(len(name) for name, _ in rows) + 1
    lines = [f"{name + ':':<{width}} {value}" for name, value in rows]
    return "\n".join([*lines, *_settings_lines()])


def _settings_lines() -> list[str]:
    """Every declared JITK_* setting: its value here (or unset), what it means now, what it
    does; then any JITK_* variable no setting declares (a typo, say)."""
    lines = ["every setting (base/settings.py):"]
    for setting, text, meaning in settings.table():
        shown = "unset" if text is None else repr(text)
        lines.append(f"  {setting.name}: {shown} -> {meaning}; {setting.doc}")
    lines += [f"  {name}: not a jitk setting (a typo?)" for name in settings.unknown()]
    return lines
