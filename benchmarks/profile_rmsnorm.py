"""Why one RMSNorm launch is slower than another: runs SGLang 0.5.23's kernel and jitk's at
each candidate of its tuning space on one shape, each once inside a profiler range, for
Nsight Compute to measure side by side (time, registers, occupancy, instructions, stalls):

    ncu --profile-from-start off --cache-control none --clock-control none \\
        --metrics "$(python benchmarks/profile_rmsnorm.py --metrics)" --csv \\
        python benchmarks/profile_rmsnorm.py 1024 5120 float16 [--in-place | --fused]

The L2 stays warm between launches (--cache-control none), as in the 10-call graphs of
bench_rmsnorm_peers.py. The launches' order is printed first (the kernels' names carry jitk's
knobs, not their tuning-file spelling). With --time, no profiler: the same launches timed as
bench_rmsnorm_peers.py times them (graph replay of 10-call chains, single calls, chains on
a weight a call with L2 flushed, and chains beside a GEMM; rounds interleaved and shared out
over --sets sets of tensors, medians), with the default also without the weight prefetch and
without PDL. Out of place and in place, SGLang's own kernel source also runs built by
jitk.load_jit and called through jitk's export ("sglang via jitk"): a control that jitk's
build and launch path costs nothing, so that a gap to SGLang lies in jitk's kernel code
(H100, 1024x7168 and 1024x5120 fp16, single calls and graph replay: 0.99-1.01 of SGLang's
own module). With --vary KNOB..., also every product of those knobs' values (norm.tuning.KNOBS)
around the tuned choice (or --around's changes to the default), built first in parallel:
where the tuning space falls short of SGLang, which knobs would close the gap (--modes and
--rounds narrow and lengthen the timing). Needs SGLang's kernels: PYTHONPATH=.peers/sgl523."""

import argparse
import itertools
import json
import os
import pathlib
import statistics
import sys

import bench_rmsnorm_peers as peers
import torch

from jitk import load_jit
from jitk.kernels import norm
from jitk.kernels.norm import rules, tuning
from jitk.tools.timing import gemm_neighbour

METRICS = ("gpu__time_duration.sum", "launch__registers_per_thread",
           "launch__occupancy_limit_registers", "launch__occupancy_limit_warps",
           "sm__warps_active.avg.pct_of_peak_sustained_active", "smsp__inst_executed.sum",
           "lts__t_bytes.sum.per_second",
           "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
           "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
           "smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio",
           "smsp__average_warps_issue_stalled_membar_per_issue_active.ratio",
           "smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio")
EPS = 1e-6


def main() -> None:
    if "--metrics" in sys.argv:
        print(",".join(METRICS))
        return
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("rows", type=int)
    parser.add_argument("hidden", type=int)
    parser.add_argument("dtype", choices=("bfloat16", "float16"))
    placement = parser.add_mutually_exclusive_group()
    placement.add_argument("--in-place", action="store_true")
    placement.add_argument("--fused", action="store_true", help="fused_add_rmsnorm (in place)")
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--vary", nargs="+", default=[], choices=tuning.KNOBS, metavar="KNOB",
                        help="with --time: also every product of these knobs' values "
                        f"(of {', '.join(tuning.KNOBS)})")
    parser.add_argument("--around", type=json.loads, default=None, metavar="JSON",
                        help="the knob changes to the default that --vary varies (default: "
                        "the tuned choice)")
    parser.add_argument("--modes", nargs="+", choices=peers.MODES, default=peers.MODES)
    parser.add_argument("--rounds", type=int, default=peers.ROUNDS)
    parser.add_argument("--sets", type=int, default=peers.SETS, metavar="N",
                        help="with --time: sets of tensors the rounds are shared out over "
                        "(the profiler runs on the first)")
    args = parser.parse_args()
    if args.vary and not args.time:
        parser.error("--vary needs --time")
    if args.sets < 1:
        parser.error(f"--sets must be at least 1, got {args.sets}")

    import sgl523

    dtype = getattr(torch, args.dtype)
    bucket = (args.hidden, dtype, args.rows) + (("in place",) if args.in_place else ())
    space = norm.FUSED_SPACE if args.fused else norm.RMSNORM_SPACE
    default = norm.default_knobs(bucket)
    extra = [{**default, "prefetch_weight": False}, {**default, "pdl": False}] if args.time else []
    extra += products(space, bucket, args.vary, args.around)
    jitk = {}  # name -> the kernels of a choice
    for knobs in space.candidates(bucket) + extra:
        changed = {k: v for k, v in knobs.items() if default[k] != v}
        name = "jitk " + (" ".join(f"{k}={v}" for k, v in changed.items()) or "default")
        jitk.setdefault(name, norm.kernels_with(bucket, knobs))  # a product may be a candidate

    def calls_on(t: dict) -> dict:
        """name -> call(weight) on the tensors `t`, each entry point called as SGLang's is."""
        x, out, residual = t["x"], t["x"] if args.in_place else t["out"], t["residual"]
        if args.fused:
            return {"sglang": lambda w: lambda: sgl523.fused_add_rmsnorm(x, residual, w, EPS),
                    **{name: lambda w, k=k: lambda: k.fused_add_rmsnorm(x, residual, w, EPS)
                       for name, k in jitk.items()}}
        return {"sglang": lambda w: lambda: sgl523.rmsnorm(x, w, out, EPS),
                "sglang via jitk": lambda w: lambda: sglang_via_jitk(x, w, out, EPS),
                **{name: lambda w, k=k: lambda: k.rmsnorm(x, w, out, EPS)
                   for name, k in jitk.items()}}

    if not args.fused:
        sglang_via_jitk = sglang_built_by_jitk(sgl523, args.hidden, dtype)
    sets = [peers.tensors(args.rows, args.hidden, dtype)
            for _ in range(args.sets if args.time else 1)]
    calls, weight = calls_on(sets[0]), sets[0]["weights"][0]
    for call in calls.values():  # build, load, warm
        for _ in range(3):
            call(weight)()
    torch.cuda.synchronize()
    if args.time:
        flush, gemm = peers.l2_flush_buffer(), gemm_neighbour(args.rows, dtype)
        for mode in args.modes:
            samples = peers.rounds_over_sets(calls_on, sets, mode, args.rounds, flush, gemm)
            for name, us in sorted(samples.items(), key=lambda item: statistics.median(
                    item[1])):
                print(f"{mode:6s} {statistics.median(us):7.3f} us  {name}", flush=True)
        return
    print("launch order:", *calls, sep="\n  ", flush=True)
    torch.cuda.profiler.start()
    for call in calls.values():
        call(weight)()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def sglang_built_by_jitk(sgl523, hidden: int, dtype: torch.dtype):
    """SGLang's RMSNorm kernel for `hidden`, the class its rmsnorm picks, compiled from its own
    source (.peers) by jitk.load_jit and called through jitk's export."""
    jit_dir = pathlib.Path(sgl523._norm.__file__).parents[2] / "jit"
    major, minor = torch.cuda.get_device_capability()
    element = "__half" if dtype == torch.float16 else "__nv_bfloat16"
    kernel = (f"sglang::{sgl523._norm._rmsnorm_kernel_class(hidden)}"
              f"<{hidden}, {str(major >= 9).lower()}, {element}>")
    module = load_jit(
        "profile_sglang_rmsnorm", hidden, element,
        cuda_files=[jit_dir / "csrc" / "elementwise" / "rmsnorm.cuh"],
        cuda_wrappers=[("run", f"{kernel}::run")], extra_include_paths=[jit_dir / "include"],
        extra_cuda_cflags=[f"-DSGL_CUDA_ARCH={major * 100 + minor * 10}"])
    return module.run


def products(space, bucket: tuple, vary: list[str], around: dict | None) -> list[dict]:
    """Every product of the values of the knobs in `vary` around `around` (changes to the
    default; None: the tuned choice), each built (in parallel) before it is returned."""
    from jitk import autotune
    from jitk.cli.common import default_precompile_archs

    if not vary:
        return []
    base = space.config(bucket) if around is None else {**norm.default_knobs(bucket), **around}
    every = [{**base, **dict(zip(vary, values))}
             for values in itertools.product(*(tuning.KNOBS[name] for name in vary))]
    default = norm.default_knobs(bucket)
    knobs = [k for k in every if k == default or rules.applies(k, *bucket[:2])]
    if len(knobs) < len(every):  # rmsnorm.cuh's tuning_applies: they would run the default
        print(f"left out {len(every) - len(knobs)} products that would run the default's "
              "kernel at this width")
    autotune.prebuild([(space.op, bucket, k) for k in knobs], default_precompile_archs()[0],
                      os.cpu_count() or 1)
    return knobs


if __name__ == "__main__":
    main()
