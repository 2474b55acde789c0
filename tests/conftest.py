"""Test set-up shared by every test file.

Without a GPU, CUDA modules are still built (for sm_90, compile only) and loaded, so every
host-side check runs on CI; tests marked `gpu` are skipped with a reason."""

import os
import shutil
import tempfile

import pytest
import torch

HAS_GPU = torch.cuda.is_available()

if not HAS_GPU:
    os.environ.setdefault("JITK_CUDA_ARCH", "9.0")
# One cache for the session, so each module is built once however many tests load it, and
# one folder for its builds (a failed one stays there for inspection). The session removes
# the folders it made here, and only those.
MADE = []
for variable, prefix in (("JITK_CACHE_DIR", "jitk-test-cache-"),
                         ("JITK_STAGING_DIR", "jitk-test-builds-")):
    if variable not in os.environ:
        os.environ[variable] = tempfile.mkdtemp(prefix=prefix)
        MADE.append(os.environ[variable])


def pytest_sessionfinish(session, exitstatus):
    for folder in MADE:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible); runs on the device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def no_shipped_table(monkeypatch):
    """This process as one no shipped tuning table is for (on a GPU that has one, the table
    would choose where a test checks the defaults)."""
    from jitk.kernels import norm
    from jitk.tools import tuning_store

    monkeypatch.setattr(tuning_store, "table_gpu", lambda: None)
    tuning_store.reread()
    for space in (norm.RMSNORM_SPACE, norm.FUSED_SPACE):
        space.forget()
    yield
    tuning_store.reread()
    for space in (norm.RMSNORM_SPACE, norm.FUSED_SPACE):
        space.forget()
