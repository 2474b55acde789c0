"""jitk: CUDA kernels compiled at run time and called from Python.

    import jitk
    jitk.rmsnorm(x, weight)                          # kernels, built on first use
    module = jitk.load_jit("mine", *jitk.make_cpp_args(128, torch.bfloat16), ...)

Importing jitk imports its kernel modules (jitk/registry.py finds them), which define the
operators torch.ops.jitk.*: a saved torch.export program that names them loads after
`import jitk`. Their kernels are built on first use. Only `python -m jitk` skips this while
it imports the package, so that `python -m jitk cache` does not pay for torch; the commands
that need the kernels import them."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import warnings

__version__ = "0.1.0"

# The toolkit's own names; each kernel module's entry points are added by registry.py.
_CORE = {
    "load_jit": "jit", "disable_jit": "jit",
    "JitCompileError": "jit", "JitCacheMissError": "jit", "JitLockError": "lock",
    "JitCacheTrustError": "trust",
    "make_cpp_args": "cpp_args", "CppArgs": "cpp_args",
    "ToolchainError": "toolchain",
    "op": "custom_op", "reference_mode": "custom_op", "Tolerance": "custom_op",
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


def _running_the_command_line() -> bool:
    """Whether this import is `python -m jitk ...` finding the package's __main__: Python
    sets sys.argv[0] to "-m" while it locates the module."""
    argv = getattr(sys, "orig_argv", [])
    return (sys.argv[:1] == ["-m"] and "-m" in argv
            and argv[argv.index("-m") + 1:][:1] == [__name__])


# torch warns at import when numpy is missing; jitk never needs numpy, so where importing
# jitk (or running its commands) imports torch, it keeps that warning quiet.
NUMPY_WARNING = "Failed to initialize NumPy"

# Where torch is installed (a process may block it: tvm-ffi and load_jit work without it).
if not _running_the_command_line() and importlib.util.find_spec("torch") is not None:
    from .registry import kernel_modules

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", NUMPY_WARNING, UserWarning)
        for _module in kernel_modules():
            importlib.import_module(_module)

if os.environ.get("JITK_VERBOSE", "0") not in ("", "0"):
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("jitk").addHandler(_handler)
    logging.getLogger("jitk").setLevel(logging.INFO)
