"""jitk.persistent: the public name of jitk.kernels.persistent (the same module object)."""

import sys

from jitk.kernels import persistent as _module

sys.modules[__name__] = _module
