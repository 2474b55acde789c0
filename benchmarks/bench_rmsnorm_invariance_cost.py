"""What batch invariance costs RMSNorm (issue 39): at each decode shape, the fastest choice of
the tuner's invariant space against the fastest of the space JITK_RMSNORM_FAST_UNSTABLE=1
opens (what the tuner picked before invariance), in one process, on the same tensors.

rmsnorm out of place and fused_add_rmsnorm, bf16 and fp16, rows 1, 16, 77, 256, 1024 x
hidden 2048, 4096, 5120, 7168, 8192. A side's choices are the ones the tuner times at the
shape's row bucket (jitk.kernels.norm.tuning.tried_values, the default among them), run
from the candidates modules the tuner builds (the invariant and the unstable one a width and
dtype, all built up front). Timing is bench_rmsnorm_peers.py's graph mode: CUDA graph replay
of 10-call chains on one weight, the providers taking turns (the order reversed every round),
queued behind a GPU sleep, the rounds shared out over sets of tensors. First every choice of
both sides is timed together and each side keeps its fastest; then the two kept choices are
timed again, in rounds of their own, so that picking the fastest of many does not favour
either side. A figure is the median of its rounds; a side's spread is half the
interquartile range of its rounds over their median; the noise is the largest of both
spreads, half the interquartile range of the per-round ratio and a step of the event timer.
Per shape: invariant/unstable, whether it lies within the noise of 1, and the verdict
against the issue's 2% (ok; "noise": above 1.02 by no more than the noise; COSTS). Summary:
the count above 1.02 beyond the noise and the geometric mean of the ratios.
    python benchmarks/bench_rmsnorm_invariance_cost.py [--quick] [--json PATH]"""

import os
import statistics
from concurrent.futures import ThreadPoolExecutor

import common
import torch
from bench_rmsnorm_peers import CALLS, EPS, event_step_us, rounds_over_sets, tensors

from jitk.kernels import norm
from jitk.kernels.norm import tuning

ROWS = (1, 16, 77, 256, 1024)
HIDDENS = (2048, 4096, 5120, 7168, 8192)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
OPS = ("rmsnorm", "fused_add_rmsnorm")
SIDES = ("invariant", "unstable")
# (screening rounds, final rounds), each shared out over SETS sets of tensors
ROUNDS, QUICK_ROUNDS = (12, 24), (6, 12)
SETS = 2
LIMIT = 1.02  # the bound on invariant / unstable


def row_bucket(rows: int) -> int:
    """The tuner's bucket of a row count: rounded up to a power of two."""
    return 1 << (rows - 1).bit_length()


def choices(hidden: int, dtype: torch.dtype, unstable: bool) -> list[tuple[tuple, int | None]]:
    """(knob values, index in the candidates module, None for the default) of every choice a
    side's candidates module holds, the default first, all with PDL."""
    candidates = tuning.candidates(hidden, dtype, True, unstable)
    default = norm.default_knobs((hidden, dtype))
    return [(tuning.knob_values(default), None),
            *((tuning.knob_values(knobs), i) for i, knobs in enumerate(candidates))]


def build_all(pairs: list[tuple[int, torch.dtype]]) -> dict:
    """(hidden, dtype, unstable) -> the candidates module's entry points, and (hidden, dtype)
    -> the default's: built (or loaded) up front, in parallel, each build its own module."""
    jobs = {**{(h, d): lambda h=h, d=d: norm.default_kernels(h, d) for h, d in pairs},
            **{(h, d, u): lambda h=h, d=d, u=u: norm.candidate_kernels(h, d, True, u)
               for h, d in pairs for u in (False, True)}}
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        futures = {key: pool.submit(job) for key, job in jobs.items()}
        return {key: future.result() for key, future in futures.items()}


def entry(modules: dict, hidden: int, dtype: torch.dtype, unstable: bool,
          index: int | None) -> tuple:
    """A choice's entry points: the default's module, or its place in a candidates module."""
    return modules[hidden, dtype] if index is None else modules[hidden, dtype, unstable][index]


def side_choices(modules: dict, op: str, dtype_name: str, rows: int, hidden: int) -> dict:
    """side -> {knob values: kernels} of the choices the tuner times at the shape's bucket."""
    dtype = DTYPES[dtype_name]
    by_side = {}
    for side in SIDES:
        unstable = side == "unstable"
        timed = tuning.tried_values(hidden, dtype, row_bucket(rows), unstable)
        by_side[side] = {values: entry(modules, hidden, dtype, unstable, index)
                         for values, index in choices(hidden, dtype, unstable) if values in timed}
    return by_side


def provider(kernels: tuple, op: str, t: dict):
    """A call of the choice on the tensors `t` with a weight it is given."""
    if op == "fused_add_rmsnorm":
        return lambda w: lambda: kernels.fused_add_rmsnorm(t["x"], t["residual"], w, EPS)
    return lambda w: lambda: kernels.rmsnorm(t["x"], w, t["out"], EPS)


def timed(kernels_by_name: dict, op: str, sets: list[dict], rounds: int) -> dict:
    """name -> us a call in every round (bench_rmsnorm_peers.py's graph mode)."""
    return rounds_over_sets(lambda t: {name: provider(kernels, op, t)
                                       for name, kernels in kernels_by_name.items()},
                            sets, "graph", rounds, flush=None)


def spread(samples: list[float]) -> float:
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return (q3 - q1) / 2 / statistics.median(samples)


def knob_changes(values: tuple, hidden: int, dtype: torch.dtype) -> str:
    """The knobs a choice sets away from the default, for the table."""
    default = norm.default_knobs((hidden, dtype))
    changed = [f"{name}={value}" for name, value in zip(tuning.KNOBS, values)
               if default[name] != value]
    return ",".join(changed) or "default"


def measure(modules: dict, op: str, dtype_name: str, rows: int, hidden: int,
            rounds: tuple[int, int], step_us: float) -> dict:
    dtype = DTYPES[dtype_name]
    by_side = side_choices(modules, op, dtype_name, rows, hidden)
    # A choice on both sides is timed once, from the invariant module (the same kernel).
    every = {values: kernels for side in SIDES[::-1] for values, kernels in by_side[side].items()}
    sets = [tensors(rows, hidden, dtype) for _ in range(SETS)]  # all alive: apart in memory
    screened = {values: statistics.median(us)
                for values, us in timed(every, op, sets, rounds[0]).items()}
    kept = {side: min(by_side[side], key=screened.__getitem__) for side in SIDES}
    final = timed({side: every[kept[side]] for side in SIDES}, op, sets, rounds[1])
    inv_us, unstable_us = (statistics.median(final[side]) for side in SIDES)
    ratios = [i / u for i, u in zip(final["invariant"], final["unstable"])]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    spreads = {side: spread(final[side]) for side in SIDES}
    noise = max(*spreads.values(), (q3 - q1) / 2, step_us / CALLS / unstable_us)
    ratio = inv_us / unstable_us
    verdict = "ok" if ratio <= LIMIT else "noise" if ratio - LIMIT <= noise else "COSTS"
    return {"op": op, "dtype": dtype_name, "rows": rows, "hidden": hidden,
            "invariant us": inv_us, "unstable us": unstable_us, "ratio": ratio,
            "invariant spread": spreads["invariant"], "unstable spread": spreads["unstable"],
            "noise": noise, "within noise": "yes" if abs(ratio - 1) <= noise else "no",
            "verdict": verdict,
            "choices": f"{len(by_side['invariant'])}/{len(by_side['unstable'])}",
            "invariant choice": knob_changes(kept["invariant"], hidden, dtype),
            "unstable choice": knob_changes(kept["unstable"], hidden, dtype),
            "same choice": kept["invariant"] == kept["unstable"], "samples": final}


def print_summary(results: list[dict]) -> None:
    beyond = [r for r in results if r["verdict"] == "COSTS"]
    within = sum(r["verdict"] == "noise" for r in results)
    same = sum(r["same choice"] for r in results)
    print(f"\n{len(results)} shapes: invariant/unstable above {LIMIT} beyond the noise at "
          f"{len(beyond)} (+{within} above it within the noise); both sides kept the same "
          f"choice at {same}; geomean "
          f"{statistics.geometric_mean(r['ratio'] for r in results):.3f}")
    for r in beyond:
        print(f"  {r['op']} {r['dtype']} {r['rows']}x{r['hidden']}: {r['invariant us']:.2f} / "
              f"{r['unstable us']:.2f} us ({r['ratio']:.3f}, noise {r['noise']:.3f}); "
              f"unstable's choice {r['unstable choice']}")


def main():
    args = common.parse_args(__doc__)
    if not torch.cuda.is_available():
        print("bench_rmsnorm_invariance_cost: skipped, no CUDA GPU (it times kernels on one)")
        return
    device = common.device_name()
    print("device:", device)
    rounds = QUICK_ROUNDS if args.quick else ROUNDS
    modules = build_all([(h, d) for d in DTYPES.values() for h in HIDDENS])
    step_us = event_step_us()
    print(f"event timer step: {step_us * 1e3:.0f} ns; rounds a shape: {rounds[0]} to pick "
          f"each side's fastest, {rounds[1]} to time the two, over {SETS} sets of tensors")
    measure(modules, OPS[0], "bf16", ROWS[0], HIDDENS[0], rounds, step_us)  # warm-up, dropped
    results = [measure(modules, op, dtype, rows, hidden, rounds, step_us)
               for op in OPS for dtype in DTYPES for hidden in HIDDENS for rows in ROWS]
    common.print_table(
        "invariant vs unstable RMSNorm choices (us a call, graph replay of 10-call chains)",
        results, ["op", "dtype", "rows", "hidden", "invariant us", "unstable us", "ratio",
                  "invariant spread", "unstable spread", "noise", "within noise", "verdict",
                  "choices", "invariant choice", "unstable choice"])
    print_summary(results)
    common.write_json(args.json, {"device": device, "event step us": step_us,
                                  "limit": LIMIT, "rows": results})


if __name__ == "__main__":
    main()
