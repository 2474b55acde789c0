"""jitk's RMSNorm and fused-add RMSNorm against SGLang 0.5.23's own, in one process, on the
same tensors: the acceptance grid of issue 18.

rmsnorm in place and out of place, fused_add_rmsnorm (in place by definition; jitk's also
with float_sum=True, against the same SGLang kernel), bf16 and fp16, rows 1, 16, 77, 256,
1024, 4096 x hidden 4096, 5120, 7168, 8192, 12288, each timed four ways: "graph", us per
call under CUDA graph replay of 10-call chains on one weight; "single", one eager call alone
on the GPU; "layers", the 10-call chain with a weight of its own per call and L2 flushed
before each replay, as decode meets each layer's weight after the rest of a step has pushed
it out of L2; "beside", the 10-call chain with a GEMM before each call (rows x 2048 by 2048
x 2048), as in a model's layer, less the 10 GEMMs alone timed in the same round. Between
CUDA events in all, queued behind a 0.1 ms sleep of the GPU, so that the events time the
device's work and not the host's launch (bench_op.py times that). The providers take turns,
which goes first alternating from round to round, after a warm-up that measures the first
shape once and drops it; a shape's rounds are shared out over --sets sets of its tensors
(SETS says why); a figure is the median of its rounds. SGLang runs twice a round, as two
providers, so that each shape shows how far SGLang's kernel reads from itself. Noise: the
largest of that distance, half the interquartile range of the per-round ratio jitk/SGLang,
and one step of the event timer (measured at the start: 32 ns on an H100, a tenth of it a
call of a 10-call chain), below which two medians cannot be told apart; a ratio above 1 by
no more than that is "within noise" and counted apart, neither as a win nor hidden. Both
providers' results are checked against float32 torch first, on fresh data; a size SGLang
refuses is reported as such. jitk runs what a lookup picks: the tuning file's choice
(`python -m jitk tune`), else the default. Needs SGLang's kernels: PYTHONPATH=.peers/sgl523
(see ../shared/peers/README.md).
Prints the counts per (op, dtype, placement, mode) and every shape jitk is slower at; the
grids of ratios go to --grids (default: stdout). --json keeps every round's times, and
--pool judges several such runs, each made in its own process, as one: single calls fall
at levels ~0.2 us apart, and which one a cell's median lands on moves from process to
process, so one run can find a cell slower that the next finds faster (H100, three calls of
4-6 runs in graph and single mode: 9-19 cells of 336 slower a run, 5-9 after pooling); each
cell slower after pooling says how many of the runs found it so.
    python benchmarks/bench_rmsnorm_peers.py [--quick] [--modes MODE ...] [--sets N]
                                             [--json PATH] [--grids PATH]
    python benchmarks/bench_rmsnorm_peers.py --pool RUN.json RUN.json ... [--json PATH]"""

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Callable

import common
import torch

import jitk
import jitk.kernels.norm  # noqa: F401  (registers the operators)
from jitk.tools.timing import gemm_neighbour

ROWS = (1, 16, 77, 256, 1024, 4096)
HIDDENS = (4096, 5120, 7168, 8192, 12288)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FLOAT_SUM = "in place, float_sum"  # jitk's fused form normalising the float32 sum
GROUPS = [(op, dtype, placement) for op, placements in
          (("rmsnorm", ("out of place", "in place")),
           ("fused_add_rmsnorm", ("in place", FLOAT_SUM)))
          for dtype in DTYPES for placement in placements]
MODES = ("graph", "single", "layers", "beside")
OTHER_KERNEL_ONLY = "the GEMM alone"  # "beside" mode's baseline, timed in each round
CALLS, ROUNDS, QUICK_ROUNDS = 10, 15, 7
# A cell's rounds are shared out over SETS sets of its tensors, allocated together so that each
# lies elsewhere in memory. Where a small call's tensors lie moves its time, and by more for
# one kernel than another (H100, 256x4096 fp16 under graph replay, jitk/SGLang over eight
# allocations in one process: 0.946-1.037 for jitk's tuned choice), while a process that
# allocates as the last one did gets the same places: with one set, a cell slower in 4 of 4
# runs (16x8192 bf16 in place, 1.011) was one allocation measured four times, 0.96 in fresh
# processes.
SETS = 3
SLEEP_CYCLES = 200_000  # ~0.1 ms at an H100's clock: longer than the host takes to queue
EPS = 1e-6


def providers(sgl523, op: str, placement: str, t: dict) -> dict:
    """name -> a call on the tensors `t` (x, out, residual) with a weight it is given; SGLang
    a second time as "sglang again"."""
    if op == "fused_add_rmsnorm":
        def call_jitk(w):
            return lambda: jitk.fused_add_rmsnorm(t["x"], t["residual"], w, EPS,
                                                  float_sum=placement == FLOAT_SUM)

        def call_sglang(w):
            return lambda: sgl523.fused_add_rmsnorm(t["x"], t["residual"], w, EPS)
    else:
        out = t["x"] if placement == "in place" else t["out"]

        def call_jitk(w):
            return lambda: jitk.rmsnorm(t["x"], w, out=out, eps=EPS)

        def call_sglang(w):
            return lambda: sgl523.rmsnorm(t["x"], w, out, EPS)
    return {"jitk": call_jitk, "sglang": call_sglang, "sglang again": call_sglang}


def tensors(rows: int, hidden: int, dtype: torch.dtype) -> dict:
    # Weights near 1 keep values finite over the repeated in-place calls of a timing; one a
    # call of a chain ("layers").
    x = torch.randn(rows, hidden, device="cuda").to(dtype)
    return {"x": x, "weights": [(0.9 + 0.2 * torch.rand(hidden, device="cuda")).to(dtype)
                                for _ in range(CALLS)],
            "out": torch.full_like(x, float("nan")), "residual": torch.randn_like(x)}


def check(sgl523, op: str, placement: str, rows: int, hidden: int, dtype: torch.dtype,
          name: str) -> str | None:
    """None when `name` matches float32 torch on fresh tensors, else why not; raises what the
    provider raises for a size it refuses."""
    t = tensors(rows, hidden, dtype)
    x, residual = t["x"].clone(), t["residual"].clone()
    source = x + residual if op == "fused_add_rmsnorm" else x
    weight = t["weights"][0]
    expected = torch.nn.functional.rms_norm(source.float(), (hidden,), weight.float(), EPS)
    providers(sgl523, op, placement, t)[name](weight)()
    got = t["out"] if placement == "out of place" else t["x"]
    try:
        torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)
        if op == "fused_add_rmsnorm":
            torch.testing.assert_close(t["residual"], source, rtol=0, atol=0)
    except AssertionError as error:
        return str(error).splitlines()[0]
    return None


def chain(calls: list) -> Callable[[], None]:
    def run() -> None:
        for call in calls:
            call()
    return run


def l2_flush_buffer() -> torch.Tensor:
    """Twice the GPU's L2: writing it leaves none of what was there before."""
    return torch.empty(2 * torch.cuda.get_device_properties().L2_cache_size, dtype=torch.uint8,
                       device="cuda")


def rounds_us(calls: dict, mode: str, rounds: int, weights: list, flush: torch.Tensor,
              other_kernel: Callable[[], object] | None = None) -> dict:
    """name -> us per call in each round, the providers alternating; the GPU drained (and for
    "layers" L2 flushed by writing `flush`), then kept asleep while the host queues the
    events and the run. "beside" runs `other_kernel` before each call, and takes off a chain
    of it alone timed in the same round."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if mode == "single":
        runs, per_run = {name: call(weights[0]) for name, call in calls.items()}, 1
        for run in runs.values():
            run()
    else:
        if mode == "beside":
            calls = {**{name: lambda w, call=call: chain([other_kernel, call(w)])
                        for name, call in calls.items()},
                     OTHER_KERNEL_ONLY: lambda w: other_kernel}
        layer_weights = weights if mode == "layers" else weights[:1] * CALLS
        runs = {name: common.captured_graph(chain([call(w) for w in layer_weights]), 1).replay
                for name, call in calls.items()}
        per_run = CALLS
    samples = {name: [] for name in calls}
    order = list(runs.items())
    for round_ in range(rounds):
        # The order reverses every round, so that no provider gains from its place in it.
        for name, run in order if round_ % 2 == 0 else order[::-1]:
            torch.cuda.synchronize()
            if mode == "layers":
                flush.zero_()
            torch.cuda._sleep(SLEEP_CYCLES)
            start.record()
            run()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) * 1e3 / per_run)
    if mode == "beside":
        alone = samples.pop(OTHER_KERNEL_ONLY)
        samples = {name: [us - other for us, other in zip(sample, alone)]
                   for name, sample in samples.items()}
    return samples


def event_step_us(samples: int = 400) -> float:
    """The event timer's step: the smallest gap between distinct times of GPU sleeps of many
    lengths, each timed between two events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = set()
    for i in range(samples):
        start.record()
        torch.cuda._sleep(i * 7)
        end.record()
        end.synchronize()
        times.add(round(start.elapsed_time(end) * 1e6))  # ns
    ordered = sorted(times)
    return min(b - a for a, b in zip(ordered, ordered[1:])) / 1e3


def verdict(ratio: float, noise: float) -> str:
    # The slack: events time in float32 milliseconds, so two medians a timer step apart
    # differ by the step to within a few parts in a million.
    return "yes" if ratio <= 1 else "noise" if ratio - 1 <= noise * 1.001 else "NO"


def measure(sgl523, op: str, dtype_name: str, placement: str, rows: int, hidden: int,
            rounds: int, flush: torch.Tensor, step_us: float,
            modes: tuple[str, ...] = MODES, sets: int = SETS) -> list[dict]:
    """The shape's row for each of `modes`, its rounds shared out over `sets` sets of tensors;
    writing `flush` empties L2; `step_us` is the event timer's step."""
    dtype = DTYPES[dtype_name]
    base = {"op": op, "dtype": dtype_name, "placement": placement, "rows": rows,
            "hidden": hidden}
    problems = {"jitk": check(sgl523, op, placement, rows, hidden, dtype, "jitk")}
    try:
        problems["sglang"] = check(sgl523, op, placement, rows, hidden, dtype, "sglang")
    except Exception as error:  # noqa: BLE001 - SGLang's own refusal, whatever its type
        reason = str(error).strip().splitlines()[-1][:120]
        return [{**base, "mode": mode, "verdict": "refused", "why": reason} for mode in modes]
    if any(problems.values()):
        raise AssertionError(f"{op} {dtype_name} {placement} {rows}x{hidden}: {problems}")
    every_set = [tensors(rows, hidden, dtype) for _ in range(sets)]  # all alive: apart
    gemm = gemm_neighbour(rows, dtype)
    return [cell({**base, "mode": mode}, rounds_over_sets(
        lambda t: providers(sgl523, op, placement, t), every_set, mode, rounds, flush, gemm),
        step_us) for mode in modes]


def rounds_over_sets(calls_on: Callable[[dict], dict], sets: list[dict], mode: str,
                     rounds: int, flush: torch.Tensor,
                     other_kernel: Callable[[], object] | None = None) -> dict:
    """rounds_us on each set of tensors in turn (`calls_on(t)`: the providers on set t), the
    rounds shared out evenly, so that each provider goes first as often: name -> us a call
    in every round."""
    per_set = 2 * -(-rounds // (2 * len(sets)))
    samples: dict[str, list[float]] = {}
    for t in sets:
        for name, us in rounds_us(calls_on(t), mode, per_set, t["weights"], flush,
                                  other_kernel).items():
            samples.setdefault(name, []).extend(us)
    return samples


def cell(row: dict, samples: dict, step_us: float) -> dict:
    """`row` with the medians of each provider's `samples` (us a call, a list of rounds a
    provider, in the order taken), jitk/SGLang, the noise and the verdict."""
    ratios = [j / s for j, s in zip(samples["jitk"], samples["sglang"])]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    jitk_us, sglang_us, again_us = (statistics.median(samples[name])
                                    for name in ("jitk", "sglang", "sglang again"))
    resolution = step_us / (1 if row["mode"] == "single" else CALLS) / sglang_us
    noise = max((q3 - q1) / 2, abs(again_us / sglang_us - 1), resolution)
    return {**row, "jitk us": jitk_us, "sglang us": sglang_us, "sglang again us": again_us,
            "ratio": jitk_us / sglang_us, "noise": noise,
            "verdict": verdict(jitk_us / sglang_us, noise), "samples": samples}


CELL_FIELDS = ("op", "dtype", "placement", "rows", "hidden", "mode")


def cell_key(row: dict) -> tuple:
    return tuple(row[k] for k in CELL_FIELDS)


def pool(runs: list[dict]) -> tuple[list[dict], float]:
    """The cells of several runs' JSON, each run made in a process of its own, as if one run
    had taken all their rounds: each provider's rounds together, in order; a cell SGLang
    refused in any run stays refused. Each pooled row counts the runs that found it slower
    ("slower in runs"). Only the modes that every run took are pooled. Returns the rows
    and the event timer's step."""
    step_us = min(run["event step us"] for run in runs)
    modes = set.intersection(*({row["mode"] for row in run["rows"]} for run in runs))
    cells: dict[tuple, list[dict]] = {}
    for run in runs:
        for row in run["rows"]:
            if row["mode"] in modes:
                cells.setdefault(cell_key(row), []).append(row)
    pooled = []
    for rows in cells.values():
        if len(rows) != len(runs):
            raise ValueError(f"{cell_key(rows[0])} is in {len(rows)} of the {len(runs)} runs")
        base = {k: rows[0][k] for k in CELL_FIELDS}
        refused = [r for r in rows if r["verdict"] == "refused"]
        if refused:
            pooled.append({**base, "verdict": "refused", "why": refused[0]["why"]})
            continue
        # Every provider has a run's rounds, so jitk/SGLang pairs rounds of one run only.
        samples = {name: [us for r in rows for us in r["samples"][name]]
                   for name in rows[0]["samples"]}
        pooled.append({**cell(base, samples, step_us),
                       "slower in runs": sum(r["verdict"] == "NO" for r in rows)})
    return pooled, step_us


def group_name(op: str, dtype: str, placement: str, mode: str) -> str:
    return f"{op} {dtype} {placement} {mode}"


def groups(results: list[dict]) -> dict[tuple, list[dict]]:
    """The rows of each (op, dtype, placement, mode), the groups in the order first met."""
    grouped: dict[tuple, list[dict]] = {}
    for r in results:
        grouped.setdefault((r["op"], r["dtype"], r["placement"], r["mode"]), []).append(r)
    return grouped


def print_grids(results: list[dict], out) -> None:
    """A grid of jitk/SGLang per group: rows x hidden, '~' within noise, '!' slower."""
    marks = {"yes": " ", "noise": "~", "NO": "!"}
    for key, rows_of_group in groups(results).items():
        cells = {(r["rows"], r["hidden"]): r for r in rows_of_group}
        print(f"\n{group_name(*key)}: jitk/SGLang (~ within noise, ! slower, - refused)",
              file=out)
        hiddens = sorted({h for _, h in cells})
        print("rows  " + "  ".join(f"{h:>6}" for h in hiddens), file=out)
        for rows in sorted({r for r, _ in cells}):
            line = [f"{cells[rows, h]['ratio']:5.3f}{marks[cells[rows, h]['verdict']]}"
                    if cells[rows, h]["verdict"] != "refused" else f"{'-':>6}" for h in hiddens]
            print(f"{rows:>4}  " + "  ".join(line), file=out)


def print_summary(results: list[dict], runs: int = 1) -> None:
    """The counts per group and the cells slower than SGLang; `runs`: how many runs `results`
    pools."""
    print(f"\n{runs} runs pooled, each in its own process." if runs > 1 else "")
    print("jitk <= SGLang per group (graph: replay of 10-call chains; single: one call;"
          " layers: 10-call chains, a weight a call, L2 flushed; beside: the chain with a GEMM"
          " before each call, less the GEMMs), the geometric mean of"
          " jitk/SGLang, and how far SGLang read from itself (median, largest)")
    for key, rows in groups(results).items():
        count = {v: sum(r["verdict"] == v for r in rows) for v in ("yes", "noise", "NO",
                                                                    "refused")}
        timed = [r for r in rows if r["verdict"] != "refused"]
        itself = [abs(r["sglang again us"] / r["sglang us"] - 1) for r in timed]
        print(f"  {group_name(*key)}: jitk <= SGLang: {count['yes']}/{len(timed)}"
              f" (+{count['noise']} within noise, {count['NO']} slower"
              + (f"; SGLang refuses {count['refused']}" if count["refused"] else "")
              + f"), geomean {statistics.geometric_mean(r['ratio'] for r in timed):.3f},"
              f" SGLang against itself {statistics.median(itself):.1%}, {max(itself):.1%}")
    refused = sorted({(r["op"], r["hidden"], r["why"]) for r in results
                      if r["verdict"] == "refused"})
    for op, hidden, why in refused:
        print(f"  SGLang refuses {op} at hidden {hidden}: {why}")
    slower = [r for r in results if r["verdict"] in ("NO", "noise")]
    if slower:
        print("\nslower (us per call, jitk / SGLang; noise: the largest of half the IQR of the"
              " round ratios, SGLang's distance from itself and a step of the event timer):")
    for r in slower:
        print(f"  {group_name(r['op'], r['dtype'], r['placement'], r['mode'])} "
              f"{r['rows']}x{r['hidden']}: {r['jitk us']:.2f} / {r['sglang us']:.2f} "
              f"({r['ratio']:.3f}, noise {r['noise']:.3f})"
              + (" within noise" if r["verdict"] == "noise" else "")
              + (f"; slower in {r['slower in runs']} of {runs} runs" if runs > 1 else ""))


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_ROUNDS} rounds a shape, not {ROUNDS}")
    parser.add_argument("--grids", metavar="PATH", help="write the grids there, not to stdout")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES,
                        help="the timings to take (default: all four)")
    parser.add_argument("--sets", type=int, default=SETS, metavar="N",
                        help=f"sets of tensors a shape's rounds are shared out over (default "
                        f"{SETS})")
    parser.add_argument("--pool", nargs="+", metavar="JSON",
                        help="measure nothing: pool the rounds of these runs' --json files")
    args = parser.parse_args()
    if args.sets < 1:
        parser.error(f"--sets must be at least 1, got {args.sets}")
    if args.pool:
        runs = []
        for path in args.pool:
            with open(path) as f:
                runs.append(json.load(f))
        device = ", ".join(sorted({run["device"] for run in runs}))
    else:
        device = common.device_name()
    print("device:", device)  # before a grid's minutes of measuring
    results, step_us = (pool(runs) if args.pool else
                        run_grid(args.quick, tuple(args.modes), args.sets))
    with open(args.grids, "w") if args.grids else contextlib.nullcontext(sys.stdout) as out:
        print_grids(results, out)
    print_summary(results, len(args.pool) if args.pool else 1)
    common.write_json(args.json, {"device": device, "event step us": step_us, "rows": results})


def run_grid(quick: bool, modes: tuple[str, ...], sets: int) -> tuple[list[dict], float]:
    """Every shape of the grid in `modes`, each on `sets` sets of tensors, on this GPU."""
    import sgl523  # SGLang's kernels; fails here, with its own message, when not set up

    sgl523.build_all(element_sizes=(), hidden_sizes=HIDDENS, dtypes=tuple(DTYPES.values()))
    rounds = QUICK_ROUNDS if quick else ROUNDS
    flush, step_us = l2_flush_buffer(), event_step_us()
    print(f"event timer step: {step_us * 1e3:.0f} ns, {rounds} rounds a shape over {sets} "
          "set(s) of tensors")
    measure(sgl523, *GROUPS[0], ROWS[0], HIDDENS[0], rounds, flush, step_us, modes, sets)
    results = [row for group in GROUPS for hidden in HIDDENS for rows in ROWS
               for row in measure(sgl523, *group, rows, hidden, rounds, flush, step_us, modes,
                                  sets)]
    return results, step_us


if __name__ == "__main__":
    main()
