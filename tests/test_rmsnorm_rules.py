"""jitk.kernels.norm's copies of rmsnorm.cuh's rules, held to the C++ at every width.

The rules module (norm.rules.module(), host functions built for sm_90, run on the CPU)
answers for the C++: the knob count, the default tuning and whether a tuning runs its own
kernel at a width (tuning_applies). The knob order is read from Tuning's template itself."""

import re
from pathlib import Path

import pytest
import torch

import jitk
from jitk.build.build_errors import JitCompileError
from jitk.kernels import norm
from jitk.kernels.norm import rules, tuning

CUH = Path(norm.__file__).with_name("rmsnorm_tiling.cuh")  # Tuning's file
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Every width up to 16384 (odd ones included), then the large sizes a model may use.
WIDTHS = (*range(1, 16385), 16386, 24576, 32768, 65536 + 8, 2**20, norm.MAX_HIDDEN)
EVERY_CHANGE = (*tuning.TRIED, *tuning.TRIED_SHORT, *tuning.TRIED_LONG,
                *tuning.TRIED_AT_SHORT_LIMIT)


@pytest.fixture(scope="module")
def cpp():
    return rules.module()


def test_knobs_are_tunings_template_parameters_in_order(cpp):
    """_KNOBS names Tuning's template parameters (kRowRegisters_ -> row_registers), in their
    order and of their types (int or bool), as many as Tuning::kKnobs holds."""
    source = CUH.read_text()
    parameters = re.search(r"template <([^>]*)>\s*struct Tuning \{", source).group(1)
    declared = re.findall(r"(int|bool) k(\w+)_", parameters)
    names = [re.sub(r"(?<!^)([A-Z])", r"_\1", name).lower() for _, name in declared]
    assert names == list(tuning.KNOBS)
    for (kind, _), values in zip(declared, tuning.KNOBS.values()):
        assert all(type(v) is (bool if kind == "bool" else int) for v in values), (kind, values)
    assert cpp.knob_count() == len(tuning.KNOBS) == 13


def test_default_knobs_are_default_tuning_at_every_width(cpp):
    for dtype in DTYPES:
        for hidden in WIDTHS:
            knobs = norm.default_knobs((hidden, dtype, 1))
            expected = tuple(cpp.default_knob(hidden, dtype.itemsize, i)
                             for i in range(len(tuning.KNOBS)))
            assert tuning.knob_values(knobs) == expected, (hidden, dtype)


def test_applies_is_tuning_applies_at_every_width(cpp):
    """Every input the C++ rule reads: the width, the dtype, max_vec_bytes and two_vectors."""
    for dtype in DTYPES:
        for hidden in WIDTHS:
            default = norm.default_knobs((hidden, dtype))
            for vec_bytes in tuning.KNOBS["max_vec_bytes"] + (4, 8):
                for two_vectors in (False, True):
                    knobs = {**default, "max_vec_bytes": vec_bytes, "two_vectors": two_vectors}
                    assert rules.applies(knobs, hidden, dtype) == cpp.tuning_applies(
                        hidden, dtype.itemsize, vec_bytes, two_vectors), (hidden, dtype, knobs)


def test_the_tuner_lists_exactly_the_choices_the_cpp_runs_as_asked(cpp):
    """Every change the tuner knows, at every width: a candidate where the C++ runs it as
    asked; else left out, never timed as a copy of the default. As written with
    JITK_RMSNORM_FAST_UNSTABLE (unstable=True); by default each candidate keeps the
    default's order of summation and runs as asked too."""
    for dtype in DTYPES:
        for hidden in WIDTHS:
            default = norm.default_knobs((hidden, dtype))
            candidates = tuning.candidates.__wrapped__(hidden, dtype, True, True)
            tried = tuning.tried_values.__wrapped__(hidden, dtype, 1024, True)
            for changes in EVERY_CHANGE:
                knobs = {**default, **changes}
                runs = cpp.tuning_applies(hidden, dtype.itemsize, knobs["max_vec_bytes"],
                                          knobs["two_vectors"])
                assert (knobs in candidates) == runs, (hidden, dtype, changes)
                if changes in (*tuning.TRIED, *tuning.TRIED_LONG):  # those tried at 1024 rows
                    assert (tuning.knob_values(knobs) in tried) == runs, (hidden, dtype, changes)
            for knobs in tuning.candidates.__wrapped__(hidden, dtype):
                assert rules.keeps_order(knobs, hidden, dtype), (hidden, dtype, knobs)
                assert cpp.tuning_applies(hidden, dtype.itemsize, knobs["max_vec_bytes"],
                                          knobs["two_vectors"]), (hidden, dtype, knobs)
    # An odd width: every access is one element, so the default is all there is to time.
    for space in (norm.RMSNORM_SPACE, norm.FUSED_SPACE):
        bucket = (4095, torch.bfloat16, 1024)
        assert space.candidates(bucket) == [norm.default_knobs(bucket)]


def test_a_choice_the_kernel_would_not_run_is_refused_before_any_build(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("JITK_CACHE_DIR", str(cache))
    for bucket, changes in (((3000, torch.float16, 1024), {"two_vectors": True}),
                            ((16384, torch.float32, 1024), {"two_vectors": True}),
                            ((4095, torch.bfloat16, 16), {"row_registers": 8}),
                            ((4096, torch.float32, 16), {"max_vec_bytes": 4})):
        knobs = {**norm.default_knobs(bucket), **changes}
        name, value = next(iter(changes.items()))
        with pytest.raises(jitk.JitkError, match=rf"rmsnorm: the tuning \({name}={value}\) "
                           rf"does not apply at hidden size {bucket[0]}") as info:
            norm.kernels_with(bucket, knobs)
        assert isinstance(info.value, ValueError)
    assert not cache.exists() or not any(cache.iterdir()), list(cache.iterdir())


def test_the_kernel_refuses_to_build_a_tuning_it_would_not_run():
    """rmsnorm.cuh's own check, for a caller that skips Python's: no silent default."""
    knobs = {**norm.default_knobs((3000, torch.float16)), "two_vectors": True}
    with pytest.raises(JitCompileError, match="would run the defaults' kernel"):
        norm.load_kernels("rmsnorm_refused", 3000, torch.float16, tuning.knob_values(knobs))


def test_threads_per_row_is_the_cpp_rule_at_every_width(cpp):
    """The copy behind keeps_order (which choices the tuner may time under batch invariance):
    every row_registers and access width the knobs name, at every width."""
    for dtype in DTYPES:
        for hidden in WIDTHS:
            for vec_bytes in (4, 8, 16):
                for registers in (*tuning.KNOBS["row_registers"], 1, 2, 12):
                    knobs = {"max_vec_bytes": vec_bytes, "row_registers": registers}
                    assert rules.threads_per_row(hidden, dtype, knobs) == cpp.threads_per_row(
                        hidden, dtype.itemsize, vec_bytes, registers), (hidden, dtype, knobs)
                    assert rules.spread(hidden, dtype, knobs) == cpp.row_spread(
                        hidden, dtype.itemsize, vec_bytes, registers), (hidden, dtype, knobs)


def test_spread_layouts_are_where_the_default_gives_a_row_whole_warps():
    """row_registers 8 and 4 keep the default's order by spreading its threads 2 and 4 times
    where the default reads a row in 16-byte accesses, four a thread, in whole warps, and the
    spread threads fit a block: hidden 1024 bf16 (one warp) to 32768 (1024 threads; 8 would
    need 2048), not 512 (16 threads), nor 8-byte accesses."""
    def knobs(registers, vec_bytes=16):
        return {"row_registers": registers, "max_vec_bytes": vec_bytes}
    bf16 = torch.bfloat16
    assert [rules.spread(4096, bf16, knobs(r)) for r in (16, 8, 4)] == [1, 2, 4]
    assert [rules.threads_per_row(4096, bf16, knobs(r)) for r in (16, 8, 4)] == [128, 256, 512]
    assert [rules.threads_per_row(5120, bf16, knobs(r)) for r in (16, 8, 4)] == [160, 320, 640]
    assert rules.threads_per_row(1032, bf16, knobs(8)) == 2 * 64  # not 129 rounded up to 160
    assert rules.spread(1024, bf16, knobs(4)) == 4 and rules.spread(512, bf16, knobs(8)) == 1
    assert rules.spread(8192, bf16, knobs(4)) == 4 and rules.spread(16384, bf16, knobs(4)) == 1
    assert rules.spread(16384, bf16, knobs(8)) == 2 and rules.spread(32768, bf16, knobs(8)) == 1
    assert rules.spread(4096, bf16, knobs(8, 8)) == 1 and rules.spread(4100, bf16, knobs(8)) == 1


def test_the_tuner_keeps_only_choices_in_the_defaults_order(monkeypatch):
    """Batch invariance: each row-count bucket may get its own choice, so every choice the
    tuner times adds a row as the default does; JITK_RMSNORM_FAST_UNSTABLE=1 lets the others
    in. At 4096 bf16 the default's 16 registers give 128 threads a row; row_registers 8 and 4
    spread them over 256 and 512 in its order; 8-byte accesses, four partial sums and
    TwoVectors each add in another order, as row_registers 8 does at 512 bf16 (a half warp)."""
    bucket = (4096, torch.bfloat16, 1024)
    default = norm.default_knobs(bucket)
    for changes in ({"row_registers": 8, "max_vec_bytes": 8}, {"sum_chains": 4},
                    {"two_vectors": True}):
        assert not rules.keeps_order({**default, **changes}, 4096, torch.bfloat16), changes
    short = norm.default_knobs((512, torch.bfloat16))
    assert not rules.keeps_order({**short, "row_registers": 8}, 512, torch.bfloat16)
    for changes in ({"row_registers": 8}, {"row_registers": 4},
                    {"broadcast_sum": True}, {"one_turn": True}, {"fill_sm": True},
                    {"pin_offsets": True, "row_first": True, "late_trigger": True},
                    {"prefetch_weight": False, "pdl": False, "register_cap": False}):
        assert rules.keeps_order({**default, **changes}, 4096, torch.bfloat16), changes
    for space in (norm.RMSNORM_SPACE, norm.FUSED_SPACE):
        for rows in (1, 256, 1024):
            for hidden, dtype in ((4096, torch.bfloat16), (5120, torch.float16),
                                  (128, torch.float32), (16384, torch.bfloat16)):
                candidates = space.candidates((hidden, dtype, rows))
                assert all(rules.keeps_order(c, hidden, dtype) for c in candidates)
                assert len(candidates) > 1, (hidden, dtype, rows)  # still a choice to make
    # At 32768 bf16 a row takes 1024 threads whatever row_registers asks: 8 keeps the order.
    wide = norm.default_knobs((32768, torch.bfloat16))
    assert rules.keeps_order({**wide, "row_registers": 8}, 32768, torch.bfloat16)
    faster = {**default, "broadcast_sum": True, "pin_offsets": True, "row_first": True,
              "sum_chains": 4, "one_turn": True}  # in TRIED, another order
    assert not tuning.tried(bucket, faster)
    monkeypatch.setenv("JITK_RMSNORM_FAST_UNSTABLE", "1")
    assert tuning.tried(bucket, faster)
