"""The parity harness (jitk.testing.check_op) on a user's host-only op, whose kernel runs on
the CPU: passing, a result never written (poison), a result beyond tolerance, ULP counts;
and every shipped op's CPU check (opcheck in reference mode over its own cases)."""

import functools
from pathlib import Path

import pytest
import torch

import jitk
import jitk.hicache
import jitk.norm
import jitk.wait_value
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
           "transfer_hicache_all_layer_mla", "stream_wait_value", "stream_write_value"]


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_op_has_a_reference_and_passes_its_cpu_check(name):
    info = jitk.custom_op.find_op(f"jitk::{name}")
    assert info.reference is not None and info.cases is not None
    reports = check_op(info, device="cpu")
    assert len(reports) == len(info.cases()) and all(r.ok for r in reports)
    assert any("schema" in r.note for r in reports)


@pytest.mark.gpu
@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_op_matches_its_reference_on_the_gpu(name):
    reports = check_op(f"jitk::{name}")
    assert reports and all(r.ok for r in reports)
