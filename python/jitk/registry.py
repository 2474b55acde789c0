"""jitk's kernel modules, found where each one declares itself.

A kernel module is a module of the jitk package that defines `precompile_configs()`. Its
`__all__` (a list of string literals) names its entry points, which `jitk.<name>` exports;
its `precompile_configs()` lists what `python -m jitk precompile` builds. Nothing else
registers a kernel. The source is read, not imported, so that `import jitk` and
`python -m jitk cache` do not pay for torch."""

from __future__ import annotations

import functools
import re
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
HOOK = "precompile_configs"
_HOOK_DEF = re.compile(rf"^def {HOOK}\(", re.MULTILINE)
# A top-level __all__ = [...] or (...) of string literals; a regular expression rather than
# the ast module, whose import alone costs more than reading every file here.
_ALL = re.compile(r"^__all__\s*=\s*[\[(]([^\])]*)[\])]", re.MULTILINE)
_STRING = re.compile(r"""^\s*(['"])([A-Za-z_]\w*)\1\s*$""")


class RegistryError(RuntimeError):
    """A kernel module's declaration cannot be read."""


def _entry_points(path: Path, text: str) -> tuple[str, ...]:
    declared = _ALL.search(text)
    items = [item for item in declared.group(1).split(",") if item.strip()] if declared else []
    literals = [_STRING.match(item) for item in items]
    if not items or not all(literals):
        raise RegistryError(f"kernel module {path} defines {HOOK}() but no __all__ of string "
                            "literals naming its entry points")
    return tuple(m.group(2) for m in literals if m.group(2) != HOOK)


@functools.cache
def kernel_modules() -> dict[str, tuple[str, ...]]:
    """{"jitk.norm": ("fused_add_rmsnorm", "rmsnorm"), ...}: every kernel module of the
    package and its entry points."""
    found = {}
    for path in sorted(PACKAGE_DIR.glob("*.py")):
        text = path.read_text()
        if _HOOK_DEF.search(text):
            found[f"jitk.{path.stem}"] = _entry_points(path, text)
    return found


def exports() -> dict[str, str]:
    """Entry point name -> the kernel module that defines it."""
    return {name: module for module, names in kernel_modules().items() for name in names}
