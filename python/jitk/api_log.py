"""jitk.api_log: the public name of jitk.tools.api_log (the same module object, not a copy)."""

import sys

from jitk.tools import api_log as _module

sys.modules[__name__] = _module
