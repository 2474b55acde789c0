"""RMSNorm built both ways in one process: nvcc (one unit) and NVRTC (the file's two halves,
load_jit(cuda_compiler="nvrtc")), the same template arguments and default tuning.

For each shape it first checks that both modules give the same bits (fresh random rows,
outputs poisoned before each call), then times them in turn: CUDA graph replay (20-call
chains) and single calls, several rounds, medians, and the ratio nvrtc / nvcc. Each round
also times nvcc against itself, whose spread says what a ratio has to pass to be a difference.
Needs a GPU.

    python benchmarks/bench_nvrtc_vs_nvcc.py [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics

import common
import torch

import jitk

SHAPES = [(rows, hidden) for hidden in (2048, 4096, 5120, 8192) for rows in (1, 16, 77, 256, 1024)]
DTYPES = (torch.bfloat16, torch.float16)


def load(compiler: str, hidden: int, dtype: torch.dtype):
    args = jitk.make_cpp_args(hidden, dtype)
    norm = f"jitk::norm::RMSNorm<{args}>"
    module = jitk.load_jit(f"bench_rmsnorm_{compiler}", *args, cuda_files=["norm/rmsnorm.cuh"],
                           cuda_compiler=compiler,
                           cuda_wrappers=[("rmsnorm", f"{norm}::run"),
                                          ("fused_add_rmsnorm", f"{norm}::run_fused_add")])
    return module.rmsnorm, module.fused_add_rmsnorm


def same_bits(kernels: dict, rows: int, hidden: int, dtype: torch.dtype) -> bool:
    x = torch.randn(rows, hidden, device="cuda").to(dtype)
    r = torch.randn(rows, hidden, device="cuda").to(dtype)
    w = torch.randn(hidden, device="cuda").to(dtype)
    outs = []
    for plain, fused in kernels.values():
        y = torch.full_like(x, float("nan"))
        plain(x, w, y, 1e-6)
        xi, ri = x.clone(), r.clone()
        fused(xi, ri, w, 1e-6)
        outs.append((y, xi, ri))
    (a, b) = outs
    return all(torch.equal(p.view(torch.int16), q.view(torch.int16)) for p, q in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="hidden 4096 and 8192 only")
    args = parser.parse_args()
    shapes = [s for s in SHAPES if not args.quick or s[1] in (4096, 8192)]
    print(common.device_name())
    ratios, spreads, rows_out, differing = {"graph": [], "single": []}, [], [], 0
    for dtype in DTYPES:
        for rows, hidden in shapes:
            kernels = {c: load(c, hidden, dtype) for c in ("nvcc", "nvrtc")}
            if not same_bits(kernels, rows, hidden, dtype):
                differing += 1
            x = torch.randn(rows, hidden, device="cuda").to(dtype)
            w = torch.randn(hidden, device="cuda").to(dtype)
            y = torch.empty_like(x)
            calls = {c: functools.partial(k[0], x, w, y, 1e-6) for c, k in kernels.items()}
            row = {"dtype": str(dtype)[6:], "shape": f"{rows}x{hidden}"}
            for mode in ("graph", "single"):
                times = {"nvcc": [], "nvrtc": [], "nvcc again": []}
                for _ in range(args.rounds):
                    for name, call in (("nvcc", calls["nvcc"]), ("nvrtc", calls["nvrtc"]),
                                       ("nvcc again", calls["nvcc"])):
                        times[name].append(common.time_graph_us(call, 20) if mode == "graph"
                                           else common.time_us(call))
                nvcc, nvrtc = statistics.median(times["nvcc"]), statistics.median(times["nvrtc"])
                again = statistics.median(times["nvcc again"])
                ratios[mode].append(nvrtc / nvcc)
                spreads.append(abs(again / nvcc - 1))
                row[f"{mode} nvcc us"] = round(nvcc, 2)
                row[f"{mode} nvrtc/nvcc"] = round(nvrtc / nvcc, 3)
                row[f"{mode} nvcc/nvcc"] = round(again / nvcc, 3)
            rows_out.append(row)
    common.print_table("RMSNorm, nvrtc / nvcc, same process", rows_out, list(rows_out[0]))
    for mode, values in ratios.items():
        geomean = math.exp(sum(map(math.log, values)) / len(values))
        print(f"{mode}: geomean nvrtc/nvcc {geomean:.3f}, range {min(values):.3f}-"
              f"{max(values):.3f}")
    print(f"nvcc/nvcc spread: median {statistics.median(spreads):.3f}, max {max(spreads):.3f}")
    print(f"shapes whose outputs differ in any bit: {differing} of {len(rows_out)}")
    if differing:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
