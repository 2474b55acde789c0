"""jitk.fib: the public name of jitk.integrations.fib (the same module object, not a copy)."""

import sys

from jitk.integrations import fib as _module

sys.modules[__name__] = _module
