"""Sweep of the RMSNorm kernel's knobs (jitk::norm::Tuning in rmsnorm_tiling.cuh) under CUDA
graph replay, to choose the defaults: the registers a thread would rather give its part of a row
(fewer spread a row over more threads), block 0 prefetching the weight into L2 before the
wait, and the rows a thread normalises at once with one copy of the weight. Each setting's
results (both entry points, vector and element-wise paths) are checked against torch first.
Settings are timed in turn, round after round, and each figure is the median of its rounds:
a drift of the clock or the temperature hits every setting alike.

Modes: "rotated" rotates inputs (in place) over 256 MB, so that rows come from DRAM; "hot"
normalises the same x in place, call after call, so that rows stay in L2; "clone" times
`x.clone()` then the norm in place on it, the same x each time, as SGLang's benchmark does;
"cold w" times two norms, as consecutive layers, each with a weight of its own that an L2
flush has evicted and an input just written (us for the two, beyond the flush and the
write). "copy" is a copy of the same bytes (the clone alone in "clone" mode). Prints us per
call per setting, and the best per shape. TUNE_RMSNORM_BASELINE=path/to/rmsnorm.cuh adds that
file's kernel (another revision's, with its own default knobs) as one more setting, "base";
it includes this checkout's jitk headers, so give it copies of its own where they differ, and
the files of its folder it includes (rmsnorm_*.cuh) beside it.
    python benchmarks/tune_rmsnorm.py [--quick] [--json PATH]"""

import itertools
import multiprocessing
import os
import statistics
from concurrent.futures import ProcessPoolExecutor

import common
import torch
from bench_rmsnorm import buffer_count, qkv_heads, rotating

from jitk import load_jit, make_cpp_args

BF16, FP32 = torch.bfloat16, torch.float32
SHAPES = [  # (label, op, dtype, rows, hidden, mode); "heads": q of a [rows, 48 x hidden] qkv
    *((f"{rows}x4096 {mode}", "rmsnorm", BF16, rows, 4096, mode)
      for mode in ("hot", "clone") for rows in (1, 16, 256, 1024)),
    *((f"1024x5120 {mode}", "rmsnorm", BF16, 1024, 5120, mode) for mode in ("hot", "clone")),
    ("1024x4096", "rmsnorm", BF16, 1024, 4096, "rotated"),
    ("4096x8192", "rmsnorm", BF16, 4096, 8192, "rotated"),
    ("32768x8192", "rmsnorm", BF16, 32768, 8192, "rotated"),
    ("fused 4096x8192", "fused", BF16, 4096, 8192, "rotated"),
    *((f"q {tokens}x32x128", "rmsnorm", BF16, tokens, 128, "heads") for tokens in (16, 4096)),
    *((f"{tokens}*32x128", "rmsnorm", BF16, tokens * 32, 128, "rotated") for tokens in (16, 4096)),
    ("q 4096x32x64", "rmsnorm", BF16, 4096, 64, "heads"),
    ("4096*32x64", "rmsnorm", BF16, 4096 * 32, 64, "rotated"),
    ("16x4096 cold w", "rmsnorm", BF16, 16, 4096, "cold"),
]
QUICK_SHAPES = {"1x4096 hot", "16x4096 hot", "256x4096 hot", "1024x4096 hot", "1024x5120 hot",
                "4096x8192", "32768x8192", "fused 4096x8192", "q 16x32x128", "16*32x128",
                "q 4096x32x128", "4096*32x128"}
# (registers for x, weight prefetch)
TUNINGS = list(itertools.product((4, 8, 16), (False, True)))
QUICK_TUNINGS = [(16, True), (8, True), (4, True)]
BASELINE = "base"  # the kernel of TUNE_RMSNORM_BASELINE, if set
ROUNDS, QUICK_ROUNDS = 7, 5
EPS = 1e-6


def load(hidden, dtype, tuning):
    args = make_cpp_args(hidden, dtype)
    if tuning == BASELINE:
        norm, knobs, source = f"jitk::norm::RMSNorm<{args}>", [BASELINE], baseline_source()
    else:
        knobs = make_cpp_args(*tuning)
        norm = f"jitk::norm::RMSNorm<{args}, jitk::norm::Tuning<{knobs}>>"
        source = "rmsnorm.cuh"
    return load_jit("rmsnorm_tune", *args, *knobs, cuda_files=[source],
                    cuda_wrappers=[("rmsnorm", f"{norm}::run"),
                                   ("fused", f"{norm}::run_fused_add")])


def baseline_source():
    return os.path.abspath(os.environ["TUNE_RMSNORM_BASELINE"])


def build(config):
    load(*config)


def prebuild(shapes, tunings):
    """Every (hidden, dtype, tuning) module, in parallel processes."""
    configs = sorted({(shape[4], shape[2], t) for shape in shapes for t in tunings}, key=str)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(16, len(configs)), mp_context=context) as pool:
        list(pool.map(build, configs))


def norm_call(module, op):
    """f(x, weight, residual): one call of the module's op, in place on x."""
    if op == "fused":
        return lambda x, w, r: module.fused(x, r, w, EPS)
    return lambda x, w, r: module.rmsnorm(x, w, x, EPS)


def check(module, dtype, hidden):
    """The setting computes what torch does, for both entry points on both paths (vectors
    and element-wise), over a row count that leaves a block's last turn part empty."""
    weight = torch.randn(hidden, device="cuda").to(dtype)
    for op, offset in itertools.product(("rmsnorm", "fused"), (0, 1)):
        x = torch.randn(37, hidden + 8, device="cuda").to(dtype)[:, offset:offset + hidden]
        residual = torch.randn_like(x)
        expected_sum = x + residual
        expected = torch.nn.functional.rms_norm(expected_sum if op == "fused" else x,
                                                (hidden,), weight, EPS)
        norm_call(module, op)(x, weight, residual)
        torch.testing.assert_close(x, expected, rtol=2e-2, atol=2e-2)
        if op == "fused":
            torch.testing.assert_close(residual, expected_sum, rtol=0, atol=0)


def setup(op, dtype, rows, hidden, mode):
    """The shape's operands: (timer, copy), where timer(call) is the us per call of
    call(x, weight, residual) in `mode` and copy() that of a copy of the same bytes."""
    weight = torch.randn(hidden, device="cuda").to(dtype)
    if mode in ("clone", "hot"):
        x = torch.randn(rows, hidden, device="cuda").to(dtype)
        if mode == "hot":
            return (lambda call: common.time_graph_us(lambda: call(x, weight, None)),
                    lambda: common.time_graph_us(lambda: x.clone()))
        return (lambda call: common.time_graph_us(lambda: call(x.clone(), weight, None)),
                lambda: common.time_graph_us(lambda: x.clone()))
    if mode == "cold":
        flush = torch.empty(96 << 20, dtype=torch.uint8, device="cuda")
        source = torch.randn(2, rows, hidden, device="cuda").to(dtype)
        pair = torch.empty_like(source)
        weights = [torch.randn_like(weight) for _ in range(2)]

        def flush_and_write():
            flush.zero_()
            pair.copy_(source)

        def both(call):
            flush_and_write()
            call(pair[0], weights[0], None)
            call(pair[1], weights[1], None)

        base = common.time_graph_us(flush_and_write, calls_per_graph=20)
        return (lambda call: common.time_graph_us(lambda: both(call), calls_per_graph=20) - base,
                lambda: base)
    numel = rows * hidden * (32 if mode == "heads" else 1)
    tensors = 4 if op == "fused" else 2
    buffers = buffer_count(tensors * numel * dtype.itemsize)
    if mode == "heads":
        xs = [qkv_heads(rows, 32, hidden, dtype) for _ in range(buffers)]
    else:
        xs = [torch.randn(rows, hidden, device="cuda").to(dtype) for _ in range(buffers)]
    residuals = [torch.randn_like(x) for x in xs] if op == "fused" else [None] * buffers
    outs = [torch.empty_like(x) for x in xs]
    copies = rotating([lambda x=x, y=y: y.copy_(x) for x, y in zip(xs, outs)])
    return (lambda call: common.time_graph_us(rotating([lambda x=x, r=r: call(x, weight, r)
                                                        for x, r in zip(xs, residuals)])),
            lambda: common.time_graph_us(copies) * tensors / 2)


def main():
    args = common.parse_args(__doc__)
    tunings = QUICK_TUNINGS if args.quick else TUNINGS
    if os.environ.get("TUNE_RMSNORM_BASELINE"):
        tunings = [*tunings, BASELINE]
    shapes = [s for s in SHAPES if s[0] in QUICK_SHAPES] if args.quick else SHAPES
    rounds = QUICK_ROUNDS if args.quick else ROUNDS
    prebuild(shapes, tunings)
    print("device:", common.device_name())
    copy_gbps = common.device_copy_gbps()
    print(f"device copy ceiling: {copy_gbps:.0f} GB/s (read + write)")
    results = []
    for label, op, dtype, rows, hidden, mode in shapes:
        numel = rows * hidden * (32 if mode == "heads" else 1)
        moved = (4 if op == "fused" else 2) * numel * dtype.itemsize + hidden * dtype.itemsize
        timer, copy = setup(op, dtype, rows, hidden, mode)
        row = {"shape": label, "MB": moved / 1e6}
        calls = {}
        for tuning in tunings:
            module = load(hidden, dtype, tuning)
            check(module, dtype, hidden)
            calls[tuning] = norm_call(module, op)
        samples = {tuning: [] for tuning in [*tunings, "copy"]}
        for _ in range(rounds):
            for tuning in tunings:
                samples[tuning].append(timer(calls[tuning]))
            samples["copy"].append(copy())
        row.update({tuning: statistics.median(s) for tuning, s in samples.items()})
        row["copy us"] = row.pop("copy")
        del timer, copy, calls
        torch.cuda.empty_cache()
        best = min(tunings, key=lambda t: row[t])
        row.update({"best": best, "best us": row[best], "GB/s": moved / row[best] / 1e3,
                    "of copy": moved / row[best] / 1e3 / copy_gbps,
                    "vs same-size copy": row["copy us"] / row[best]})
        results.append(row)
        print(f"{label}: best {best} {row[best]:.2f} us, copy {row['copy us']:.2f} us",
              flush=True)

    names = {t: t if t == BASELINE else "r{}{}".format(t[0], "W" if t[1] else "-")
             for t in tunings}
    print(f"\nus per call under graph replay, median of {rounds} rounds; setting = "
          "rREGISTERS, W weight prefetch")
    table = [{"setting": names[t], **{r["shape"]: r[t] for r in results}} for t in tunings]
    table.append({"setting": "copy", **{r["shape"]: r["copy us"] for r in results}})
    common.print_table("rmsnorm tuning sweep", table, ["setting", *(r["shape"] for r in results)])
    for r in results:
        r["best"] = names[r["best"]]
    common.print_table("best per shape", results,
                       ["shape", "MB", "best", "best us", "GB/s", "of copy", "vs same-size copy"])
    common.write_json(args.json, {"device": common.device_name(), "copy_gbps": copy_gbps,
                                  "rows": [{k if isinstance(k, str) else names[k]: v
                                            for k, v in r.items()} for r in results]})


if __name__ == "__main__":
    main()
