"""benchmarks/bench_rmsnorm_invariance_cost.py without a GPU: which choices each side times at
a shape, where each lives in its candidates module, and the one-line skip."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_rmsnorm_invariance_cost as bench  # noqa: E402

from jitk.kernels.norm import rules, tuning  # noqa: E402


class Modules(dict):
    """Stands in for build_all's modules: each entry names where it was taken from."""

    def __missing__(self, key):
        return [(*key, index) for index in range(64)] if len(key) == 3 else (*key, "default")


@pytest.mark.parametrize("rows", bench.ROWS)
@pytest.mark.parametrize("hidden", bench.HIDDENS)
def test_each_side_times_the_tuners_choices_at_the_bucket_from_its_module(rows, hidden):
    dtype = torch.float16
    by_side = bench.side_choices(Modules(), "rmsnorm", "fp16", rows, hidden)
    for side, unstable in (("invariant", False), ("unstable", True)):
        assert set(by_side[side]) == tuning.tried_values(hidden, dtype, bench.row_bucket(rows),
                                                         unstable)
        candidates = tuning.candidates(hidden, dtype, True, unstable)
        for values, (*key, place) in by_side[side].items():
            knobs = dict(zip(tuning.KNOBS, values))
            if place == "default":
                assert knobs == rules.default_knobs((hidden, dtype))
            else:
                assert key == [hidden, dtype, unstable] and candidates[place] == knobs
    assert all(rules.keeps_order(dict(zip(tuning.KNOBS, values)), hidden, dtype)
               for values in by_side["invariant"])


def test_the_unstable_side_times_choices_that_break_the_order():
    by_side = bench.side_choices(Modules(), "rmsnorm", "bf16", 16, 4096)
    assert any(not rules.keeps_order(dict(zip(tuning.KNOBS, values)), 4096, torch.bfloat16)
               for values in by_side["unstable"])


def test_row_buckets_are_the_tuners():
    assert [bench.row_bucket(rows) for rows in bench.ROWS] == [1, 16, 128, 256, 1024]


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" /
                                                 "bench_rmsnorm_invariance_cost.py"),
                             "--quick", "--json", str(tmp_path / "out.json")],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "bench_rmsnorm_invariance_cost: skipped, no CUDA GPU (it times kernels on one)"]
