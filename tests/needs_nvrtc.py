"""The skip mark of tests that build with NVRTC: where libnvrtc cannot be loaded (no
nvidia-cuda-nvrtc wheel, no toolkit library), they skip and say why."""

import pytest

from jitk.build import nvrtc


def _missing() -> str | None:
    try:
        nvrtc.version()
    except nvrtc.NvrtcError as error:
        return str(error)
    return None


NEEDS_NVRTC = pytest.mark.skipif(_missing() is not None, reason=f"no NVRTC here: {_missing()}")
