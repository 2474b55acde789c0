"""The peer benchmark's verdict over several runs (benchmarks/bench_rmsnorm_peers.py --pool):
each provider's rounds pooled, jitk/SGLang paired round by round. Pure arithmetic on the
runs' JSON: no GPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_rmsnorm_peers as bench  # noqa: E402

STEP_US = 0.032
SHAPE = {"op": "rmsnorm", "dtype": "bf16", "placement": "in place", "rows": 256,
         "hidden": 7168, "mode": "single"}


def run(jitk: list[float], sglang: list[float], again: list[float], shape: dict = SHAPE) -> dict:
    """One run's JSON as the benchmark writes it, one cell."""
    row = bench.cell(dict(shape), {"jitk": jitk, "sglang": sglang, "sglang again": again},
                     STEP_US)
    return {"device": "test", "event step us": STEP_US, "rows": [row]}


def test_a_cell_slower_in_one_run_only_is_judged_on_all_rounds():
    slow = run([5.9] * 8, [5.7] * 8, [5.7] * 8)     # jitk 3.5% behind, no spread
    fast = run([5.6] * 7, [5.7] * 7, [5.7] * 7)
    assert slow["rows"][0]["verdict"] == "NO" and fast["rows"][0]["verdict"] == "yes"
    (pooled,), step = bench.pool([slow, fast, fast])
    assert step == STEP_US
    assert pooled["samples"]["jitk"] == [5.9] * 8 + [5.6] * 14
    assert pooled["jitk us"] == 5.6 and pooled["sglang us"] == 5.7
    assert pooled["verdict"] == "yes" and pooled["slower in runs"] == 1


def test_a_cell_slower_in_every_run_stays_slower():
    runs = [run([5.9, 6.0, 5.95], [5.7, 5.7, 5.72], [5.71, 5.7, 5.7]) for _ in range(3)]
    (pooled,), _ = bench.pool(runs)
    assert pooled["verdict"] == "NO" and pooled["slower in runs"] == 3
    assert pooled["ratio"] == pytest.approx(5.95 / 5.7)


def test_the_noise_band_is_of_round_ratios_not_of_times_that_move_between_runs():
    # Run 2 is slower for both providers alike: a spread of pooled times, or jitk's rounds of
    # one run against SGLang's of another, would widen the band the verdict allows.
    a = run([10.0, 10.1, 10.0, 10.1], [10.0, 10.0, 10.1, 10.1], [10.0, 10.0, 10.1, 10.1])
    b = run([20.0, 20.2, 20.0, 20.2], [20.0, 20.0, 20.2, 20.2], [20.0, 20.0, 20.2, 20.2])
    (pooled,), _ = bench.pool([a, b])
    assert pooled["noise"] < 0.01


def test_refused_anywhere_is_refused():
    refused = {"device": "test", "event step us": STEP_US,
               "rows": [{**SHAPE, "verdict": "refused", "why": "hidden 12288"}]}
    (pooled,), _ = bench.pool([run([1.0] * 3, [1.0] * 3, [1.0] * 3), refused])
    assert pooled["verdict"] == "refused" and pooled["why"] == "hidden 12288"


def test_runs_of_other_grids_are_refused():
    other = run([1.0] * 3, [1.0] * 3, [1.0] * 3, {**SHAPE, "rows": 1024})
    with pytest.raises(ValueError, match="in 1 of the 2 runs"):
        bench.pool([run([1.0] * 3, [1.0] * 3, [1.0] * 3), other])


def test_only_the_modes_every_run_took_are_pooled():
    graph = run([1.0] * 3, [1.0] * 3, [1.0] * 3, {**SHAPE, "mode": "graph"})
    both = {**graph, "rows": graph["rows"] + run([1.0] * 3, [1.0] * 3, [1.0] * 3)["rows"]}
    pooled, _ = bench.pool([both, graph])
    assert [row["mode"] for row in pooled] == ["graph"]


def test_the_command_prints_the_pooled_verdict(tmp_path):
    paths = []
    for i, times in enumerate(([5.9] * 5, [6.0] * 5)):
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps(run(times, [5.7] * 5, [5.7] * 5)))
        paths.append(str(path))
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_rmsnorm_peers.py"),
                             "--pool", *paths, "--grids", str(tmp_path / "grids")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "2 runs pooled" in result.stdout
    assert "rmsnorm bf16 in place single 256x7168: 5.95 / 5.70" in result.stdout
    assert "slower in 2 of 2 runs" in result.stdout


def test_sets_below_one_are_refused_before_anything_is_measured():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_rmsnorm_peers.py"),
                             "--sets", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--sets must be at least 1, got 0" in result.stderr
    assert "device:" not in result.stdout
