"""The parity harness (jitk.testing.check_op) on a user's host-only op, whose kernel runs on
the CPU: passing, a result never written (poison), a result beyond tolerance, ULP counts;
and every shipped op's CPU check (opcheck in reference mode over its own cases)."""

import functools
import inspect
from pathlib import Path

import pytest
import torch

import jitk
import jitk.kernels.hicache
import jitk.kernels.norm
import jitk.kernels.wait_value
from jitk.testing import Case, ParityError, check_op, measure

KERNEL = Path(__file__).resolve().parent / "csrc" / "cpu_axpy.h"


@functools.cache
def _module():
    return jitk.load_jit("cpu_axpy", cpp_files=[KERNEL], cpp_wrappers=[("axpy", "cpu_axpy::axpy")])


def _scaled_reference(x: torch.Tensor, out: torch.Tensor, alpha: float) -> None:
    out.copy_(x * alpha)


@jitk.op("jitk_parity::scaled", mutates_args=("out",), reference=_scaled_reference,
         tolerance=jitk.Tolerance(1e-6, 1e-6))
def scaled(x: torch.Tensor, out: torch.Tensor, alpha: float) -> None:
    out.zero_()
    _module().axpy(alpha, x, out)


@jitk.op("jitk_parity::forgets_the_tail", mutates_args=("out",), reference=_scaled_reference)
def forgets_the_tail(x: torch.Tensor, out: torch.Tensor, alpha: float) -> None:
    """Writes all but the last element: the poison shows."""
    out[:-1] = x[:-1] * alpha


@jitk.op("jitk_parity::rounds_coarsely", mutates_args=("out",), reference=_scaled_reference,
         tolerance=jitk.Tolerance(0.0, 2**-8))
def rounds_coarsely(x: torch.Tensor, out: torch.Tensor, alpha: float) -> None:
    """Off by one part in 64: beyond the declared 1/256."""
    out.copy_(x * alpha * (1 + 2**-6))


def cases():
    def make(n, device):
        x = torch.randn(n, device=device)
        return (x, torch.empty_like(x), 1.5), {}

    return [Case(f"n={n}", functools.partial(make, n), outputs=("out",)) for n in (1, 17, 4099)]


def test_a_correct_op_passes_with_figures_per_case():
    reports = check_op(scaled, cases(), device="cpu", kernels=True)
    assert [r.case for r in reports] == ["n=1", "n=17", "n=4099"]
    assert all(r.ok and r.tensor == "out" and r.max_abs <= 1e-6 for r in reports)


def test_a_result_never_written_fails_on_the_poison():
    with pytest.raises(ParityError, match="NaN where the reference has none"):
        check_op(forgets_the_tail, cases(), device="cpu", kernels=True)


def test_a_result_beyond_tolerance_fails_and_reports_ulps():
    reports = check_op(rounds_coarsely, cases(), device="cpu", kernels=True,
                       raise_on_failure=False)
    assert not any(r.ok for r in reports)
    # x * 2^-6 relative is 2^17 float32 ulps (eps 2^-23), give or take a binade.
    assert all(2**16 <= r.max_ulps <= 2**18 for r in reports)
    assert all(abs(r.max_rel - 2**-6) < 1e-6 for r in reports)


def test_ulps_in_the_results_dtype():
    one = torch.tensor([1.0, 2.0, -4.0], dtype=torch.bfloat16)
    step = torch.tensor([1.0078125, 2.0, -4.0625], dtype=torch.bfloat16)  # +1 ulp, 0, -2 ulp
    report = measure("op", "case", "out", step, one, None)  # torch's bf16 default: 1.6e-2
    assert report.max_ulps == 2 and report.max_abs == 0.0625 and report.ok
    assert not measure("op", "case", "out", step, one, jitk.Tolerance(0.0, 2**-8)).ok


@jitk.op("jitk_parity::unreferenced", mutates_args=())
def unreferenced(x: torch.Tensor) -> None:
    pass


def test_an_op_without_reference_or_cases_is_refused():
    with pytest.raises(ValueError, match="has no reference"):
        check_op(unreferenced, cases())
    with pytest.raises(ValueError, match="has no cases"):
        check_op(scaled)


SHIPPED = ["rmsnorm", "fused_add_rmsnorm", "transfer_hicache_one_layer",
           "transfer_hicache_one_layer_mla", "transfer_hicache_all_layer",
           "transfer_hicache_all_layer_mla", "transfer_hicache_all_layer_staged_lf_pf",
           "transfer_hicache_all_layer_mla_staged_lf_pf", "stream_wait_value",
           "stream_write_value"]


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_op_has_a_reference_and_passes_its_cpu_check(name):
    info = jitk.runtime.op.find_op(f"jitk::{name}")
    assert info.reference is not None and info.cases is not None
    # the reference takes the op's parameters, kinds and defaults
    assert [(p.name, p.kind, p.default) for p in inspect.signature(
        info.reference).parameters.values()] == [(p.name, p.kind, p.default) for p in
                                                 info.signature.parameters.values()]
    reports = check_op(info, device="cpu")
    assert len(reports) == len(info.cases()) and all(r.ok for r in reports)
    assert any("schema" in r.note for r in reports)


@pytest.mark.gpu
@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_op_matches_its_reference_on_the_gpu(name):
    reports = check_op(f"jitk::{name}")
    assert reports and all(r.ok for r in reports)


def _hicache_reference(name):
    return jitk.runtime.op.find_op(f"jitk::transfer_hicache_{name}").reference


def test_hicache_references_move_what_sglang_moves():
    """Every index one row whatever page_size says; runs of page_size (only their first index
    read) under index_granularity="page"; a run out of range skipped; a paged cache's slots
    under two strides; all-layer page strides; the staged write-back a chunk at a time."""
    src = torch.arange(20.0).view(10, 2)
    dst = torch.zeros(6, 2)
    _hicache_reference("one_layer_mla")(dst, torch.tensor([0, 5, 7]), src,
                                        torch.tensor([9, 1, 2]), page_size=4)
    assert dst.tolist() == [[18, 19], [0, 0], [0, 0], [0, 0], [0, 0], [2, 3]]  # 7: past the end
    dst = torch.zeros(8, 2)
    _hicache_reference("one_layer_mla")(dst, torch.tensor([4, -7, 6, -7]), src,
                                        torch.tensor([2, -7, 0, -7]), page_size=2,
                                        index_granularity="page")
    assert dst[4:].flatten().tolist() == [4, 5, 6, 7, 0, 1, 2, 3] and not dst[:4].any()
    padded = torch.zeros(2, 6, 2)  # pages of 4 slots, 6 rows apart
    _hicache_reference("one_layer_mla")(padded[:, :4], torch.tensor([5]), src,
                                        torch.tensor([3]))
    assert padded[1, 1].tolist() == [6, 7] and padded.sum() == 13

    layer = torch.arange(120.0).view(30, 4)  # rows of 16 bytes; pages of 2 slots, 3 rows apart
    out = torch.zeros(8, 4)
    _hicache_reference("all_layer_mla")(
        torch.tensor([out.data_ptr()]), torch.tensor([1, 2]), torch.tensor([layer.data_ptr()]),
        torch.tensor([3, 40]), cache_src_stride_bytes=16, cache_dst_stride_bytes=16,
        page_size=2, cache_src_page_stride_bytes=48, num_tokens_src=20)
    assert out[1].tolist() == layer[4].tolist() and out.count_nonzero() == 4  # 40: skipped

    layers = [torch.randn(12, 8) for _ in range(3)]
    firsts_src, firsts_dst = [4, 0, 8], [2, 0, 4]
    host, staging = torch.zeros(6, 3, 8), torch.full((3, 3, 8), float("nan"))  # a page of 2
    _hicache_reference("all_layer_mla_staged_lf_pf")(
        torch.tensor([t.data_ptr() for t in layers]),
        torch.tensor([i for first in firsts_src for i in (first, -1)]),
        torch.tensor([i for first in firsts_dst for i in (first, -1)]), staging, host,
        page_size=2)
    for first_src, first_dst in zip(firsts_src, firsts_dst):
        for j in range(2):
            assert torch.equal(host[first_dst + j], torch.stack([t[first_src + j]
                                                                 for t in layers]))
    assert torch.equal(staging[:2], host[4:6]) and staging[2].isnan().all()  # the last chunk
