"""jitk: CUDA kernels compiled at run time and called from Python.

    import jitk
    jitk.rmsnorm(x, weight)                          # kernels, built on first use
    module = jitk.load_jit("mine", *jitk.make_cpp_args(128, torch.bfloat16), ...)

Names are imported on first use, so `python -m jitk cache` does not pay for torch."""

from __future__ import annotations

import importlib
import logging
import os

__version__ = "0.1.0"

_EXPORTS = {
    "load_jit": "jit", "JitCompileError": "jit",
    "make_cpp_args": "cpp_args", "CppArgs": "cpp_args",
    "ToolchainError": "toolchain",
    "op": "custom_op",
    "rmsnorm": "norm", "fused_add_rmsnorm": "norm",
    "transfer_hicache_one_layer": "hicache", "transfer_hicache_all_layer": "hicache",
    "transfer_hicache_one_layer_mla": "hicache", "transfer_hicache_all_layer_mla": "hicache",
    "stream_wait_value": "wait_value", "stream_write_value": "wait_value", "Event": "wait_value",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jitk' has no attribute '{name}'")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if os.environ.get("JITK_VERBOSE", "0") not in ("", "0"):
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("jitk").addHandler(_handler)
    logging.getLogger("jitk").setLevel(logging.INFO)
