"""jitk.autotune: the public name of jitk.tools.autotune (the same module object, not a copy)."""

import sys

from jitk.tools import autotune as _module

sys.modules[__name__] = _module
