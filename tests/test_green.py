"""jitk.split_sms: disjoint SM partitions (CUDA green contexts made from one split).

CPU part: the module builds for sm_90 and bad arguments are refused before any CUDA call. GPU
part: blocks launched on the two streams run on disjoint sets of SMs, each no larger than its
partition, while torch's contexts made one at a time overlap (why this module exists)."""

from __future__ import annotations

import pytest
import torch
from errors import expect_error

import jitk
from jitk.kernels.green import _module, sm_ids


def test_module_builds():
    kernels = _module()
    assert all(hasattr(kernels, name) for name in ("split", "destroy", "record_sm_ids"))


@pytest.mark.parametrize("sms, device, fragments", [
    (0, None, ["sms must be an int >= 1", "got 0"]),
    (True, None, ["sms must be an int >= 1", "True"]),
    ("8", None, ["sms must be an int >= 1", "'8'"]),
    (8, "cpu", ["split_sms(device=...) must be a CUDA device", "got 'cpu'"]),
])
def test_arguments_refused(sms, device, fragments):
    expect_error(lambda: jitk.split_sms(sms, device), *fragments, kind=ValueError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU-less refusal")
def test_no_gpu_refused():
    expect_error(lambda: jitk.split_sms(8), "split_sms splits a GPU's SMs, and PyTorch sees no "
                 "GPU", kind=RuntimeError)


@pytest.mark.parametrize("handles, fragments", [
    (torch.zeros(5, dtype=torch.int64), ["'handles'", "Size mismatch", "expected 6", "got 5"]),
    (torch.zeros(6, dtype=torch.int32), ["'handles'", "dtype"]),
    (torch.zeros(6, 2, dtype=torch.int64)[:, 0], ["'handles'", "Stride mismatch"]),
])
def test_bad_handles_refused(handles, fragments):
    expect_error(lambda: _module().destroy(handles), "green_context.cuh:", *fragments)


@pytest.mark.parametrize("out, spin, fragments", [
    (torch.zeros(4, dtype=torch.int32), -1, ["spin_cycles must be >= 0, got -1"]),
    (torch.zeros(4, dtype=torch.int32), 0, ["'out'", "Device mismatch", "expected cuda"]),
    (torch.zeros(4, dtype=torch.int64), 0, ["'out'", "dtype"]),
    (torch.zeros(4, 2, dtype=torch.int32), 0, ["'out'", "Dimension mismatch: expected 1 dims"]),
])
def test_bad_sm_ids_arguments_refused(out, spin, fragments):
    expect_error(lambda: _module().record_sm_ids(out, spin, 0), "green_context.cuh:", *fragments)


@pytest.mark.gpu
def test_partitions_are_disjoint():
    total = torch.cuda.get_device_properties(0).multi_processor_count
    with jitk.split_sms(8) as split:
        assert split.own_sms >= 8 and split.own_sms + split.rest_sms == total
        own = set(sm_ids(4 * total, split.own))
        rest = set(sm_ids(4 * total, split.rest))
        assert own.isdisjoint(rest), sorted(own & rest)
        assert len(own) <= split.own_sms and len(rest) <= split.rest_sms
        assert len(own) == split.own_sms  # 4 blocks an SM, each spinning: every SM got one
        x = torch.randn(256, 256, device="cuda")
        with torch.cuda.stream(split.rest):
            y = x @ x
        split.rest.synchronize()
        torch.testing.assert_close(y, x @ x)
    split.close()  # a second close does nothing


@pytest.mark.gpu
def test_split_leaves_some_sms():
    total = torch.cuda.get_device_properties(0).multi_processor_count
    expect_error(lambda: jitk.split_sms(total), "sms must leave some of the device's",
                 f"{total} SMs")
