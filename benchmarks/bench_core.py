"""Core costs: cold build and warm load of a small CUDA module, and the host time of one
call of a small kernel (the per-call Python + tvm-ffi + launch path)."""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LOAD = (
    "import sys, time; sys.path.insert(0, 'tests'); import torch, jitk.jit, probes\n"
    "t = time.perf_counter(); probes.launch_probe(); print(time.perf_counter() - t)\n"
)


def load_seconds(cache: str) -> float:
    """Seconds spent in load_jit in a fresh process (imports excluded)."""
    env = {**os.environ, "JITK_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, env=env,
                         cwd=ROOT, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def host_us_per_call(fn, calls=2000, rounds=5) -> float:
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def main():
    args = common.parse_args(__doc__)
    print("device:", common.device_name())
    with tempfile.TemporaryDirectory() as cache:
        cold = load_seconds(cache)
        warm = sorted(load_seconds(cache) for _ in range(3))[1]
    sys.path.insert(0, str(ROOT / "tests"))
    import probes

    add_one = probes.launch_probe().add_one
    x = torch.randn(1024, device="cuda")
    y = torch.empty_like(x)
    rows = [
        {"what": "cold build, launch_probe (s)", "value": cold},
        {"what": "warm load in a new process (ms)", "value": warm * 1e3},
        {"what": "host time per call, jitk add_one (us)", "value": host_us_per_call(lambda: add_one(x, y))},
        {"what": "host time per call, torch add (us)", "value": host_us_per_call(lambda: torch.add(x, 1, out=y))},
    ]
    common.print_table("core costs", rows, ["what", "value"])
    common.write_json(args.json, {"device": common.device_name(), "rows": rows})


if __name__ == "__main__":
    main()
