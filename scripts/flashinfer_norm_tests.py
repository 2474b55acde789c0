"""FlashInfer's own RMSNorm tests (its tests/utils/test_norm.py), run against jitk (issue 39).

    python scripts/flashinfer_norm_tests.py TEST_NORM_PY [pytest args...]   # needs a GPU

The test file is FlashInfer's, unchanged, carried beside the checkout (the device has no
network; it is not part of jitk). It imports `flashinfer`; this script puts a stand-in
package first on the path whose `norm.rmsnorm` and `fused_add_rmsnorm` call jitk's, and runs
the file's tests of those two ops at FlashInfer's own tolerances: plain and q/k-norm (3-D)
rows, contiguous or not, strides past INT32_MAX, tensors of more than 2^31 elements. The
tests of ops jitk does not have (quantised, Gemma, LayerNorm, FlashInfer's own build) are
not run. `enable_pdl` is accepted and left to jitk, which chooses programmatic dependent
launch itself. The stand-in's fused_add_rmsnorm asks for FlashInfer's formula (float_sum=True),
as a user swapping jitk in for FlashInfer would. Exits with pytest's status."""

import os
import sys
import tempfile
from pathlib import Path

import pytest

# FlashInfer's test functions that call only rmsnorm / fused_add_rmsnorm.
SELECTED = ("test_norm", "test_qknorm", "test_fused_add_rmsnorm", "test_rmsnorm_int64_stride",
            "test_qknorm_int64_stride", "test_fused_add_rmsnorm_int64_stride",
            "test_rmsnorm_contiguous_overflow", "test_fused_add_rmsnorm_contiguous_overflow",
            "test_qk_rmsnorm_contiguous_overflow")

STAND_IN = {
    "__init__.py": """
from . import jit, norm, utils
from .norm import fused_add_rmsnorm
""",
    "norm.py": '''
import torch
import jitk


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    """FlashInfer's signature: out of place, into `out` when given."""
    return jitk.rmsnorm(input, weight, out=torch.empty_like(input) if out is None else out,
                        eps=eps)


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    """FlashInfer's formula: the float32 sum is normalised, before it is rounded."""
    jitk.fused_add_rmsnorm(input, residual, weight, eps, float_sum=True)
''',
    "utils.py": """
import torch


def device_support_pdl(device):
    return torch.cuda.get_device_capability(device)[0] >= 9
""",
    # Imported at the top of the test file, used only by a deselected test.
    "jit/__init__.py": "from . import core, env\n",
    "jit/env.py": "",
    "jit/core.py": """
def gen_jit_spec(*args, **kwargs):
    raise NotImplementedError("FlashInfer's own build is not what this run tests")
""",
}


def main(argv: list[str]) -> int:
    if not argv or not Path(argv[0]).is_file():
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    test_file, extra = argv[0], argv[1:]
    with tempfile.TemporaryDirectory(prefix="jitk-fi-") as root:
        for name, text in STAND_IN.items():
            path = Path(root, "flashinfer", name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text.lstrip())
        sys.path.insert(0, root)  # this process, and pytest-xdist's workers (-n N):
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get(
            "PYTHONPATH")]))
        # Node ids, not -k: a keyword would also pick test_norm_quant and the like.
        return pytest.main([*(f"{test_file}::{name}" for name in SELECTED), "-q",
                            "-p", "no:cacheprovider", "--rootdir", root, *extra])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
