"""jitk: CUDA kernels compiled at run time and called from Python."""

from __future__ import annotations

import logging
import os

from .cpp_args import CppArgs, make_cpp_args
from .jit import JitCompileError, load_jit
from .toolchain import ToolchainError

__version__ = "0.1.0"
__all__ = ["CppArgs", "JitCompileError", "ToolchainError", "load_jit", "make_cpp_args"]

if os.environ.get("JITK_VERBOSE", "0") not in ("", "0"):
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("jitk").addHandler(_handler)
    logging.getLogger("jitk").setLevel(logging.INFO)
