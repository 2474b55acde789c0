"""jitk's kernel families, listed here and nowhere else.

A family is a package under jitk/kernels/ that defines `precompile_configs()`; its `__all__`
(a list of string literals) names its entry points, which `jitk.<name>` exports, and its
`precompile_configs()` lists what `python -m jitk precompile` builds. The `__all__` is read
from the source, not imported, so that `import jitk` and `python -m jitk cache` do not pay
for torch."""

from __future__ import annotations

import functools
import re
from pathlib import Path

from jitk.base.errors import JitkError

PACKAGE_DIR = Path(__file__).resolve().parent.parent
# The shipped families with entry points and precompile configurations, in the order
# `python -m jitk precompile` lists them. (jitk/kernels/persistent is a family too, but its
# kernels are the user's op tables: it is reached as jitk.persistent and builds per table.)
FAMILIES = ("green", "hicache", "norm", "wait_value")
HOOK = "precompile_configs"
_HOOK_DEF = re.compile(rf"^def {HOOK}\(", re.MULTILINE)
# A top-level __all__ = [...] or (...) of string literals; a regular expression rather than
# the ast module, whose import alone costs more than reading every file here.
_ALL = re.compile(r"^__all__\s*=\s*[\[(]([^\])]*)[\])]", re.MULTILINE)
_STRING = re.compile(r"""^\s*(['"])([A-Za-z_]\w*)\1\s*$""")


class RegistryError(JitkError, RuntimeError):
    """A kernel family's declaration cannot be read."""


def module_of(family: str) -> str:
    """"norm" -> "jitk.kernels.norm"."""
    return f"jitk.kernels.{family}"


def family_of(module: str) -> str:
    """The short name a command line shows: "jitk.kernels.norm" -> "norm"; other modules
    (a project's own) as they are."""
    return module.removeprefix("jitk.kernels.")


def _entry_points(path: Path, text: str) -> tuple[str, ...]:
    declared = _ALL.search(text)
    items = [item for item in declared.group(1).split(",") if item.strip()] if declared else []
    literals = [_STRING.match(item) for item in items]
    if not items or not all(literals):
        raise RegistryError(f"kernel family {path} defines {HOOK}() but no __all__ of string "
                            "literals naming its entry points")
    return tuple(m.group(2) for m in literals if m.group(2) != HOOK)


@functools.cache
def kernel_modules() -> dict[str, tuple[str, ...]]:
    """{"jitk.kernels.norm": ("fused_add_rmsnorm", "rmsnorm"), ...}: every shipped family's
    module and its entry points."""
    found = {}
    for family in FAMILIES:
        path = PACKAGE_DIR / "kernels" / family / "__init__.py"
        text = path.read_text()
        if not _HOOK_DEF.search(text):
            raise RegistryError(f"kernel family {path} defines no {HOOK}()")
        found[module_of(family)] = _entry_points(path, text)
    return found


def exports() -> dict[str, str]:
    """Entry point name -> the kernel module that defines it."""
    return {name: module for module, names in kernel_modules().items() for name in names}
