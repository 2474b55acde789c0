"""benchmarks/bench_hicache.py without a GPU: one line saying it skipped, exit status 0, and
no JSON (there is nothing measured to write)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_hicache.py"),
                             "--quick", "--json", str(tmp_path / "out.json")],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "bench_hicache: skipped, no CUDA GPU (it times transfers on one)"]
    assert not (tmp_path / "out.json").exists()
