"""RMSNorm's batch invariance on the GPU (docs/developer_guide/verifying_and_tuning.md,
"Batch invariance"): every choice the tuner may pick, and the public entry points with a
shipped table in use, give each row the bits it gets alone, at every batch size, plain, in
place and fused; 16-bit outputs within one ulp of float64; and the check's own findings on a
planted difference. (The persistent worker's chain RMSNorm against jitk.rmsnorm:
tests/persistent_cases.py, case rmsnorm_bits.)"""

import json

import pytest
import torch

from jitk.kernels import norm
from jitk.kernels.norm import invariance
from jitk.tools import autotune, tuning_store


def test_ulps_are_the_dtypes_at_the_exact_value():
    """The accuracy check's measure: 1 ulp at 1.0 is 2^-7 in bfloat16, 2^-10 in float16;
    subnormals count in the smallest step."""
    exact = torch.tensor([1.0, 1.0, 2.0**-20], dtype=torch.float64)
    for dtype, ulp, tiny_step in ((torch.bfloat16, 2.0**-7, 2.0**-133),
                                  (torch.float16, 2.0**-10, 2.0**-24)):
        out = torch.tensor([1.0 + ulp, 1.0 - ulp / 2, 2.0**-20], dtype=dtype)
        got = invariance._ulps(out, exact)
        assert got[:2].tolist() == [1.0, 0.5]
        assert got[2].item() == abs(out[2].double().item() - 2.0**-20) / (
            tiny_step if dtype == torch.float16 else 2.0**-20 * 2.0**-7)


def test_the_default_run_samples_the_choices_the_full_one_takes_all():
    choices = list(range(12))  # the default first
    assert invariance._sampled(choices, full=False) == [0, 1, 4, 8]
    assert invariance._sampled(choices, full=True) == choices
    assert invariance._sampled(choices[:3], full=False) == choices[:3]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", invariance.DTYPES, ids=str)
@pytest.mark.parametrize("hidden", invariance.WIDTHS)
def test_every_choice_gives_each_row_its_bits_alone(hidden, dtype):
    findings = list(invariance.check_width(hidden, dtype, full=True))
    assert [f.line() for f in findings if f.differing] == []


@pytest.mark.gpu
def test_a_shipped_table_keeps_the_bits(tmp_path, monkeypatch):
    """A table choosing, for each bucket, a choice other than the default (the first the
    tuner tries at every row count): the public entry points still give every row its bits
    alone."""
    hidden, dtype = 4096, torch.bfloat16
    here = autotune.environment()
    other = norm.tuning_choices(hidden, dtype)[1][0]
    entries = [{"op": op, "bucket": [hidden, "bfloat16", rows, *extra], "config": other}
               for rows in (1, 4, 16, 128, 256, 1024, 4096)
               for op, extra in (("jitk::rmsnorm", ()), ("jitk::rmsnorm", ("in place",)),
                                 ("jitk::fused_add_rmsnorm", ()))]
    (tmp_path / autotune.table_name(here["gpu"])).write_text(json.dumps(
        {"format": autotune.FORMAT, "gpu": here["gpu"], "sms": here["sms"], "entries": entries}))
    monkeypatch.setattr(tuning_store, "tuning_file", lambda: tmp_path / "none.json")  # no file
    for space in (norm.RMSNORM_SPACE, norm.FUSED_SPACE):
        monkeypatch.setattr(space, "tables", tmp_path)
        space.forget()
    tuning_store.reread()
    try:
        assert norm.RMSNORM_SPACE.config((hidden, dtype, 1024)) == other
        findings = list(invariance.check_width(hidden, dtype))
        assert [f.line() for f in findings if f.differing] == []
    finally:
        for space in (norm.RMSNORM_SPACE, norm.FUSED_SPACE):
            space.forget()
        tuning_store.reread()


@pytest.mark.gpu
def test_the_check_finds_rows_that_differ(monkeypatch):
    """With JITK_RMSNORM_FAST_UNSTABLE=1 the choices include other orders of summation: four
    partial sums a thread at 4096 bf16 must show rows whose bits differ from the default's."""
    monkeypatch.setenv("JITK_RMSNORM_FAST_UNSTABLE", "1")
    four_sums = [c for c in norm.tuning_choices(4096, torch.bfloat16) if c[0]["sum_chains"] == 4]
    assert four_sums
    monkeypatch.setattr(invariance, "tuning_choices",
                        lambda hidden, dtype: [norm.tuning_choices(hidden, dtype)[0],
                                               four_sums[0]])
    findings = [f for f in invariance.check_width(4096, torch.bfloat16) if f.differing]
    assert any("sum_chains=4" in f.case for f in findings), [f.line() for f in findings]
