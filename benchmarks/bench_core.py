"""Core costs: the cold build and warm load of a small CUDA module and of each shipped
module, and the host time of one call of a small kernel (the per-call Python + tvm-ffi +
launch path).

Without a GPU (JITK_CUDA_ARCH must then be set, e.g. 9.0) only the cold builds and warm
loads are timed: `JITK_CUDA_ARCH=9.0 PYTHONPATH=tests python benchmarks/bench_core.py --quick`
(tests/ holds the small module, probes.py)."""

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import common
import probes
import torch

from jitk.tools.precompile import KERNEL_MODULES

ROOT = Path(__file__).resolve().parent.parent
# What a first call of each module does in a new process, timed around load_jit alone: the
# small test module, then each shipped module's first configuration. Imports and CUDA's own
# start-up (a second or more when no other process holds the GPU) come before the clock, as
# in a program whose tensors are already on the GPU.
SMALL = "import probes; label, build = 'add_one', probes.launch_probe"
SHIPPED = "import importlib; label, build = importlib.import_module('{}').precompile_configs()[0]"
TIMED = "\nimport time; t = time.perf_counter(); build(); print(label, time.perf_counter() - t)"


def load_seconds(setup: str, cache: str) -> tuple[str, float]:
    env = {**os.environ, "JITK_CACHE_DIR": cache}
    code = ("import torch, jitk.build.jit\n"
            "if torch.cuda.is_available(): torch.zeros(1, device='cuda')\n" + setup + TIMED)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=ROOT, check=True)
    label, seconds = out.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    return label, float(seconds)


def first_call_rows(repeats: int) -> list[dict]:
    """Cold build (empty cache) and warm load (built) of each module: medians of `repeats`."""
    rows = []
    for module, setup in [("launch_probe", SMALL),
                          *((m, SHIPPED.format(m)) for m in KERNEL_MODULES)]:
        cold, warm = [], []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as cache:
                label, seconds = load_seconds(setup, cache)
                cold.append(seconds)
                warm.append(load_seconds(setup, cache)[1])
        name = module.removeprefix("jitk.")
        rows.append({"what": f"cold build, {name} {label} (s)", "value": statistics.median(cold)})
        rows.append({"what": f"warm load, {name} (ms)", "value": statistics.median(warm) * 1e3})
    return rows


def main():
    args = common.parse_args(__doc__)
    repeats = 1 if args.quick else 3
    if not torch.cuda.is_available():
        device = f"no GPU (builds for JITK_CUDA_ARCH={os.environ.get('JITK_CUDA_ARCH')})"
        print("device:", device)
        rows = first_call_rows(repeats)
        common.print_table("core costs", rows, ["what", "value"])
        common.write_json(args.json, {"device": device, "rows": rows})
        return
    print("device:", common.device_name())
    add_one = probes.launch_probe().add_one
    x = torch.randn(1024, device="cuda")
    y = torch.empty_like(x)
    rows = [
        *first_call_rows(repeats),
        {"what": "host time per call, jitk add_one (us)",
         "value": common.host_us_per_call(lambda: add_one(x, y))},
        {"what": "host time per call, torch add (us)",
         "value": common.host_us_per_call(lambda: torch.add(x, 1, out=y))},
    ]
    common.print_table("core costs", rows, ["what", "value"])
    common.write_json(args.json, {"device": common.device_name(), "rows": rows})


if __name__ == "__main__":
    main()
