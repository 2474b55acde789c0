"""jitk.testing: the public name of jitk.tools.testing (the same module object, not a copy)."""

import sys

from jitk.tools import testing as _module

sys.modules[__name__] = _module
