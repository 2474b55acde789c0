"""jitk: CUDA kernels compiled at run time and called from Python.

    import jitk
    jitk.rmsnorm(x, weight)                          # kernels, built on first use
    module = jitk.load_jit("mine", *jitk.make_cpp_args(128, torch.bfloat16), ...)

Names are imported on first use, so `python -m jitk cache` does not pay for torch. The
kernels' names come from the kernel modules themselves (jitk/registry.py)."""

from __future__ import annotations

import importlib
import logging
import os

__version__ = "0.1.0"

# The toolkit's own names; each kernel module's entry points are added by registry.py.
_CORE = {
    "load_jit": "jit", "disable_jit": "jit",
    "JitCompileError": "jit", "JitCacheMissError": "jit", "JitLockError": "lock",
    "JitCacheTrustError": "trust",
    "make_cpp_args": "cpp_args", "CppArgs": "cpp_args",
    "ToolchainError": "toolchain",
    "op": "custom_op",
}


def _exports() -> dict[str, str]:
    from .registry import exports

    return {**_CORE, **{name: module.removeprefix("jitk.") for name, module in exports().items()}}


def __getattr__(name: str):
    if name == "__all__":
        return sorted(_exports())
    module = _CORE.get(name) or _exports().get(name)
    if module is None:
        raise AttributeError(f"module 'jitk' has no attribute '{name}'")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_exports()])


if os.environ.get("JITK_VERBOSE", "0") not in ("", "0"):
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("jitk").addHandler(_handler)
    logging.getLogger("jitk").setLevel(logging.INFO)
