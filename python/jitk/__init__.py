"""jitk: CUDA kernels compiled at run time and called from Python.

    import jitk
    jitk.rmsnorm(x, weight)                          # kernels, built on first use
    module = jitk.load_jit("mine", *jitk.make_cpp_args(128, torch.bfloat16), ...)

The package stands in floors, each importing only from those below it (tests/test_layout.py
holds it to that): base (version, errors, settings) -> build (toolchain, cache, locks,
load_jit; no torch) -> runtime (the op layer, the family registry, streams) -> tools
(logging, replay, parity testing, tuning, precompile, timing) -> kernels/<family> ->
integrations (FlashInfer-Bench) -> cli. This module and the public names beside it
(jitk.persistent, jitk.testing, jitk.autotune, jitk.fib, jitk.api_log) stand on top.

Importing jitk imports its kernel families (jitk/runtime/registry.py lists them), which define
the operators torch.ops.jitk.*: a saved torch.export program that names them loads after
`import jitk`. Their kernels are built on first use. Only `python -m jitk` skips this while
it imports the package, so that `python -m jitk cache` does not pay for torch; the commands
that need the kernels import them."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings

from jitk.base import NUMPY_WARNING
from jitk.base import __version__ as __version__
from jitk.base.errors import JitkError as JitkError

# The toolkit's own names (module under jitk); each family's entry points come from the
# registry.
_CORE = {
    "load_jit": "build.jit", "disable_jit": "build.jit", "jit_stats": "build.events",
    "JitCompileError": "build.jit", "JitCacheMissError": "build.jit",
    "JitLockError": "build.lock", "JitCacheTrustError": "build.trust",
    "make_cpp_args": "build.cpp_args", "CppArgs": "build.cpp_args",
    "ToolchainError": "build.toolchain",
    "op": "runtime.op", "reference_mode": "runtime.op", "Tolerance": "runtime.op",
    "ArgumentError": "base.errors", "ArgumentTypeError": "base.errors",
    "SettingError": "base.errors",
}
# Public modules under their short names (each file beside this one makes the same alias).
_MODULES = {"persistent": "kernels.persistent", "testing": "tools.testing",
            "autotune": "tools.autotune", "fib": "integrations.fib",
            "api_log": "tools.api_log"}


def _exports() -> dict[str, str]:
    from jitk.runtime.registry import exports

    return {**_CORE, **{name: module.removeprefix("jitk.") for name, module in exports().items()}}


def __getattr__(name: str):
    if name == "__all__":
        return sorted(_exports())
    if name in _MODULES:
        return importlib.import_module(f"jitk.{name}")
    module = _exports().get(name)
    if module is None:
        raise AttributeError(f"module 'jitk' has no attribute '{name}'")
    value = getattr(importlib.import_module(f"jitk.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_exports(), *_MODULES])


def _running_the_command_line() -> bool:
    """Whether this import is `python -m jitk ...` finding the package's __main__: Python
    sets sys.argv[0] to "-m" while it locates the module."""
    argv = getattr(sys, "orig_argv", [])
    return (sys.argv[:1] == ["-m"] and "-m" in argv
            and argv[argv.index("-m") + 1:][:1] == [__name__])


# Where torch is installed (a process may block it: tvm-ffi and load_jit work without it).
if not _running_the_command_line() and importlib.util.find_spec("torch") is not None:
    from jitk.runtime.registry import kernel_modules

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", NUMPY_WARNING, UserWarning)
        importlib.import_module("jitk.tools.api_log")  # every op's calls logged as set
        for _module in kernel_modules():
            importlib.import_module(_module)

from jitk.base import settings as _settings  # noqa: E402

_settings.apply_verbose()
