"""jitk.kernels.norm's copies of rmsnorm.cuh's rules, held to the C++ at every width.

The rules module (norm.rules.module(), host functions built for sm_90, run on the CPU)
answers for the C++: the knob count, the default tuning and whether a tuning runs its own
kernel at a width (tuning_applies). The knob order is read from Tuning's template itself."""

import re
from pathlib import Path

import pytest
import torch

import jitk
from jitk.build.builder import JitCompileError
from jitk.kernels import norm
from jitk.kernels.norm import rules

CUH = Path(norm.__file__).with_name("rmsnorm.cuh")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Every width up to 16384 (odd ones included), then the large sizes a model may use.
WIDTHS = (*range(1, 16385), 16386, 24576, 32768, 65536 + 8, 2**20, norm._MAX_HIDDEN)
EVERY_CHANGE = (*norm._TRIED, *norm._TRIED_SHORT, *norm._TRIED_LONG, *norm._TRIED_AT_SHORT_LIMIT)


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
    assert names == list(norm._KNOBS)
    for (kind, _), values in zip(declared, norm._KNOBS.values()):
        assert all(type(v) is (bool if kind == "bool" else int) for v in values), (kind, values)
    assert cpp.knob_count() == len(norm._KNOBS) == 13


def test_default_knobs_are_default_tuning_at_every_width(cpp):
    for dtype in DTYPES:
        for hidden in WIDTHS:
            knobs = norm._default_knobs((hidden, dtype, 1))
            expected = tuple(cpp.default_knob(hidden, dtype.itemsize, i)
                             for i in range(len(norm._KNOBS)))
            assert norm._knob_values(knobs) == expected, (hidden, dtype)


def test_applies_is_tuning_applies_at_every_width(cpp):
    """Every input the C++ rule reads: the width, the dtype, max_vec_bytes and two_vectors."""
    for dtype in DTYPES:
        for hidden in WIDTHS:
            default = norm._default_knobs((hidden, dtype))
            for vec_bytes in norm._KNOBS["max_vec_bytes"] + (4, 8):
                for two_vectors in (False, True):
                    knobs = {**default, "max_vec_bytes": vec_bytes, "two_vectors": two_vectors}
                    assert norm._applies(knobs, hidden, dtype) == cpp.tuning_applies(
                        hidden, dtype.itemsize, vec_bytes, two_vectors), (hidden, dtype, knobs)


def test_the_tuner_lists_exactly_the_choices_the_cpp_runs_as_asked(cpp):
    """Every change the tuner knows, at every width: a candidate where the C++ runs it as
    asked; else left out, never timed as a copy of the default."""
    for dtype in DTYPES:
        for hidden in WIDTHS:
            default = norm._default_knobs((hidden, dtype))
            candidates = norm._candidates.__wrapped__(hidden, dtype)
            tried = norm._tried_values.__wrapped__(hidden, dtype, 1024)
            for changes in EVERY_CHANGE:
                knobs = {**default, **changes}
                runs = cpp.tuning_applies(hidden, dtype.itemsize, knobs["max_vec_bytes"],
                                          knobs["two_vectors"])
                assert (knobs in candidates) == runs, (hidden, dtype, changes)
                if changes in (*norm._TRIED, *norm._TRIED_LONG):  # those tried at 1024 rows
                    assert (norm._knob_values(knobs) in tried) == runs, (hidden, dtype, changes)
    # An odd width: every access is one element, so the default is all there is to time.
    for space in (norm._RMSNORM_SPACE, norm._FUSED_SPACE):
        bucket = (4095, torch.bfloat16, 1024)
        assert space.candidates(bucket) == [norm._default_knobs(bucket)]


def test_a_choice_the_kernel_would_not_run_is_refused_before_any_build(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("JITK_CACHE_DIR", str(cache))
    for bucket, changes in (((3000, torch.float16, 1024), {"two_vectors": True}),
                            ((16384, torch.float32, 1024), {"two_vectors": True}),
                            ((4095, torch.bfloat16, 16), {"row_registers": 8}),
                            ((4096, torch.float32, 16), {"max_vec_bytes": 4})):
        knobs = {**norm._default_knobs(bucket), **changes}
        name, value = next(iter(changes.items()))
        with pytest.raises(jitk.JitkError, match=rf"rmsnorm: the tuning \({name}={value}\) "
                           rf"does not apply at hidden size {bucket[0]}") as info:
            norm._kernels_with(bucket, knobs)
        assert isinstance(info.value, ValueError)
    assert not cache.exists() or not any(cache.iterdir()), list(cache.iterdir())


def test_the_kernel_refuses_to_build_a_tuning_it_would_not_run():
    """rmsnorm.cuh's own check, for a caller that skips Python's: no silent default."""
    knobs = {**norm._default_knobs((3000, torch.float16)), "two_vectors": True}
    with pytest.raises(JitCompileError, match="would run the defaults' kernel"):
        norm._load("rmsnorm_refused", 3000, torch.float16, norm._knob_values(knobs))
