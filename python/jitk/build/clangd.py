"""A .clangd file that lets clangd understand jitk kernels.

jitk kernels are compiled at run time, so there is no compile_commands.json; this file
gives clangd the flags load_jit would use: CUDA, C++20, and the jitk, tvm-ffi, DLPack and
CUDA include directories of this installation."""

from __future__ import annotations

import os
from pathlib import Path

from jitk.base.errors import JitkError
from jitk.build import toolchain

CONFIG_NAME = ".clangd"
# A .clangd holding this line was written by jitk and may be rewritten by it.
MARKER = "# jitk-clangd: written by `python -m jitk`; delete this line to keep your edits."
DEFAULT_ARCH = "9.0"


class ForeignConfigError(JitkError, RuntimeError):
    """A .clangd that jitk did not write is in the way."""


def editor_arch() -> str:
    """$JITK_CUDA_ARCH's first entry, else the current GPU's, else 9.0.

    The environment is checked first because looking for a GPU imports torch (seconds)."""
    if os.environ.get(toolchain.ARCH_ENV):
        return toolchain.parse_archs(os.environ[toolchain.ARCH_ENV])[0]
    capability = toolchain.current_gpu_capability()
    if capability is None:
        return DEFAULT_ARCH
    return f"{capability[0]}.{capability[1]}"


def include_dirs() -> list[Path]:
    """jitk's headers, then tvm-ffi's and DLPack's (the same folder in a wheel: kept once)."""
    from tvm_ffi.libinfo import find_dlpack_include_path, find_include_path

    from jitk.build.jit import INCLUDE_DIR

    dirs = [INCLUDE_DIR, Path(find_include_path()), Path(find_dlpack_include_path())]
    return list(dict.fromkeys(d.resolve() for d in dirs))


def render(arch: str, includes: list[Path], cuda_path: Path) -> str:
    flags = ["-xcuda", f"--cuda-gpu-arch={toolchain.sm_name(arch)}", "-std=c++20",
             f"--cuda-path={cuda_path}", *(f"-I{d}" for d in includes)]
    lines = [MARKER, "CompileFlags:", "  Add:", *(f"    - {flag}" for flag in flags)]
    return "\n".join(lines) + "\n"


def is_ours(path: Path) -> bool:
    return MARKER in path.read_text(errors="replace").splitlines()


def write(directory: Path, force: bool = False) -> tuple[Path, str]:
    """Writes directory/.clangd; returns its path and contents. Raises ForeignConfigError
    rather than replace a .clangd that jitk did not write, unless `force`."""
    path = directory / CONFIG_NAME
    if path.exists() and not force and not is_ours(path):
        raise ForeignConfigError(
            f"{path} exists and was not written by jitk; left it as it is "
            "(pass --force to replace it)"
        )
    text = render(editor_arch(), include_dirs(), toolchain.cuda_home())
    path.write_text(text)
    return path, text
