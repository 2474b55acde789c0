"""Sweep of the RMSNorm kernel's knobs (jitk::norm::Tuning in rmsnorm.cuh) under CUDA graph
replay, to choose the defaults: the registers a thread would rather give its part of a row
(fewer spread a row over more threads), a persistent grid, where the next kernel may launch
(PDL trigger at the start or after the stores), and an L2 prefetch of the weight before the
wait. "cold w" shapes time two norms, as consecutive layers, each with a weight of its own
that an L2 flush has evicted and an input just written: the us shown is for the two, beyond
the flush and the write. Prints us per call per setting, and the best per shape.
    python benchmarks/tune_rmsnorm.py [--quick] [--json PATH]"""

import itertools
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from bench_rmsnorm import buffer_count, qkv_heads, rotating  # noqa: E402

from jitk import load_jit, make_cpp_args  # noqa: E402
from jitk.norm import rmsnorm  # noqa: E402

BF16 = torch.bfloat16
SHAPES = [  # (label, dtype, rows, hidden, layout); layout "heads": q of a [rows, 48 x hidden] qkv
    ("1x4096", BF16, 1, 4096, "rows"),
    ("16x4096", BF16, 16, 4096, "rows"),
    ("256x4096", BF16, 256, 4096, "rows"),
    ("1024x4096", BF16, 1024, 4096, "rows"),
    ("1024x5120", BF16, 1024, 5120, "rows"),
    ("4096x8192", BF16, 4096, 8192, "rows"),
    ("32768x8192", BF16, 32768, 8192, "rows"),
    ("q 16x32x128", BF16, 16, 128, "heads"),
    ("q 4096x32x128", BF16, 4096, 128, "heads"),
    ("4096*32x128", BF16, 4096 * 32, 128, "rows"),
    ("16x4096 cold w", BF16, 16, 4096, "cold"),
    ("256x4096 cold w", BF16, 256, 4096, "cold"),
]
TUNINGS = list(itertools.product((4, 8, 16), (False, True), (False, True), (False, True)))
QUICK_TUNINGS = [(4, True, False, True), (16, True, False, True), (16, False, False, False)]


def load(hidden, dtype, tuning):
    args = make_cpp_args(hidden, dtype)
    knobs = make_cpp_args(*tuning)
    norm = f"jitk::norm::RMSNorm<{args}, jitk::norm::Tuning<{knobs}>>"
    return load_jit("rmsnorm_tune", *args, *knobs, cuda_files=["rmsnorm.cuh"],
                    cuda_wrappers=[("rmsnorm", f"{norm}::run")]).rmsnorm


def build(config):
    load(*config)


def prebuild(tunings):
    """Every (hidden, dtype, tuning) module, in parallel processes."""
    configs = sorted({(hidden, dtype, t) for _, dtype, _, hidden, _ in SHAPES for t in tunings},
                     key=str)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(16, len(configs)), mp_context=context) as pool:
        list(pool.map(build, configs))


def operands(dtype, rows, hidden, layout):
    """Rotating (x, weight) pairs; q/k-norm layouts run in place, as a model does."""
    if layout == "heads":
        buffers = buffer_count(2 * rows * 32 * hidden * dtype.itemsize)
        xs = [qkv_heads(rows, 32, hidden, dtype) for _ in range(buffers)]
    else:
        buffers = buffer_count(2 * rows * hidden * dtype.itemsize)
        xs = [torch.randn(rows, hidden, device="cuda").to(dtype) for _ in range(buffers)]
    return xs, torch.randn(hidden, device="cuda").to(dtype)


def time_us(kernel, xs, weight, layout):
    if layout != "cold":
        return common.time_graph_us(rotating([lambda x=x: kernel(x, weight) for x in xs]))
    flush = torch.empty(96 << 20, dtype=torch.uint8, device="cuda")
    source = torch.randn(2, *xs[0].shape, device="cuda").to(xs[0].dtype)
    pair = torch.empty_like(source)
    weights = [torch.randn_like(weight) for _ in range(2)]

    def flush_and_write():
        flush.zero_()
        pair.copy_(source)

    def both():
        flush_and_write()
        kernel(pair[0], weights[0])
        kernel(pair[1], weights[1])

    return (common.time_graph_us(both, calls_per_graph=20)
            - common.time_graph_us(flush_and_write, calls_per_graph=20))


def main():
    args = common.parse_args(__doc__)
    tunings = QUICK_TUNINGS if args.quick else TUNINGS
    prebuild(tunings)
    print("device:", common.device_name())
    copy_gbps = common.device_copy_gbps()
    print(f"device copy ceiling: {copy_gbps:.0f} GB/s (read + write)")
    results = []
    for label, dtype, rows, hidden, layout in SHAPES:
        xs, weight = operands(dtype, rows, hidden, layout)
        moved = 2 * xs[0].numel() * dtype.itemsize + hidden * dtype.itemsize
        outs = [torch.empty_like(x) for x in xs]
        copy_us = common.time_graph_us(rotating([lambda x=x, y=y: y.copy_(x)
                                                 for x, y in zip(xs, outs)]))
        row = {"shape": label, "MB": moved / 1e6, "copy us": copy_us,
               "default": time_us(lambda x, w: rmsnorm(x, w), xs, weight, layout)}
        for tuning in tunings:
            kernel = load(hidden, dtype, tuning)
            row[tuning] = time_us(lambda x, w, k=kernel: k(x, w, x, 1e-6), xs, weight, layout)
        best = min(tunings, key=lambda t: row[t])
        row.update({"best": best, "best us": row[best], "GB/s": moved / row[best] / 1e3,
                    "of copy": moved / row[best] / 1e3 / copy_gbps,
                    "vs same-size copy": copy_us / row[best]})
        results.append(row)
        print(f"{label}: best {best} {row[best]:.2f} us, default {row['default']:.2f} us, "
              f"copy {copy_us:.2f} us", flush=True)
        del xs, outs
        torch.cuda.empty_cache()

    names = {t: "r{}{}{}{}".format(t[0], "P" if t[1] else "-", "L" if t[2] else "-",
                                   "W" if t[3] else "-") for t in tunings}
    print("\nus per call under graph replay; setting = rREGISTERS, P persistent grid, "
          "L late PDL trigger, W weight prefetch")
    table = [{"setting": names[t], **{r["shape"]: r[t] for r in results}} for t in tunings]
    table.append({"setting": "default", **{r["shape"]: r["default"] for r in results}})
    table.append({"setting": "same-size copy", **{r["shape"]: r["copy us"] for r in results}})
    common.print_table("rmsnorm tuning sweep", table, ["setting", *(r["shape"] for r in results)])
    for r in results:
        r["best"] = names[r["best"]]
    common.print_table("best per shape", results,
                       ["shape", "MB", "best", "best us", "GB/s", "of copy", "vs same-size copy",
                        "default"])
    common.write_json(args.json, {"device": common.device_name(), "copy_gbps": copy_gbps,
                                  "rows": [{k if isinstance(k, str) else names[k]: v
                                            for k, v in r.items()} for r in results]})


if __name__ == "__main__":
    main()
