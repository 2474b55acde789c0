"""Test set-up shared by every test file.

Without a GPU, CUDA modules are still built (for sm_90, compile only) and loaded, so every
host-side check runs on CI; tests marked `gpu` are skipped with a reason."""

import os
import tempfile

import pytest
import torch

HAS_GPU = torch.cuda.is_available()

if not HAS_GPU:
    os.environ.setdefault("JITK_CUDA_ARCH", "9.0")
# One cache for the session, so each module is built once however many tests load it.
os.environ.setdefault("JITK_CACHE_DIR", tempfile.mkdtemp(prefix="jitk-test-cache-"))


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible); runs on the device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
