"""The persistent worker against launches and CUDA graphs (issue 21).

A step is a chain of 180 small ops on one row of 4096 bf16, each reading the previous output:
rmsnorm, scale, add in turn. It runs as
  (a) 180 eager launches (jitk.rmsnorm, torch.mul, torch.add with out=),
  (b) one CUDA graph of those 180 kernels, replayed,
  (c) 180 items pushed to a running worker on 8 SMs (jitk/kernels/persistent/
      persistent_chain.cuh): one batched push of a prepared chain per step, and one push per
      item.
Every step time runs from the host's issue to the host seeing the last result (a synchronize,
or the worker's completion counter), median over many steps; (a) and (b) also by CUDA events.
The graph and the worker run in alternating rounds (the worker started and stopped in each),
so that a drift of the GPU's clocks reaches both; the ratio is the median of the rounds'.
Per item: the slope between chains of 18 and 180 items (the op's own time included). First
item: one scale item, push to host-visible completion. Beside a bf16 GEMM (8192^3): in
alternating rounds, the GEMM alone and beside a spinning thread, an idle worker and one running
chains, on the whole GPU or with the GPU split (jitk.split_sms) into the worker's 8 SMs and the
GEMM's rest; each round's time against that round's GEMM alone.

Everything torch launches is run once before the worker starts: a kernel's first launch
under CUDA's lazy loading would wait for the resident worker (jitk.persistent's docstring).

    PYTHONPATH=tests python benchmarks/bench_persistent.py [--quick] [--json PATH]
"""

from __future__ import annotations

import statistics
import threading
import time

import torch
from common import device_name, parse_args, print_table, write_json
from persistent_cases import chain_items, chain_worker, test_worker

import jitk
from jitk.tools.timing import captured_graph, median_us

N, OPS, SHORT_OPS, BLOCKS = 4096, 180, 18, 8
GEMM = 8192
# Issue 21's goals (H100).
GOAL_STEP_VS_GRAPH = 0.5
GOAL_ITEM_US = 1.0
GOAL_GEMM_SLOWDOWN = 0.08
# An idle block's longest sleep between looks for work: the default, and longer ones.
IDLE_POLLS_US = (0.256, 8.0, 1000.0)
GEMM_REPEATS = 10


def eager_chain(x, w, bufs, n_ops):
    def run():
        src = x
        for i in range(n_ops):
            dst = bufs[i % 2]
            if i % 3 == 0:
                jitk.rmsnorm(src, w, out=dst)
            elif i % 3 == 1:
                torch.mul(src, 1.25, out=dst)
            else:
                torch.add(src, x, out=dst)
            src = dst
    return run


def host_us(fn, steps: int) -> float:
    """Median host microseconds from issuing fn to seeing its end (fn waits itself)."""
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def empty_item_us(steps: int) -> float:
    """The worker's own time per item: the slope between chains of 18 and 180 empty items
    (the test table's `nothing` op)."""
    worker = test_worker(capacity=1024)
    chains = {n: worker.prepare([("nothing", {"unused": 0})] * n, chain=True)
              for n in (SHORT_OPS, OPS)}
    worker.start(blocks=BLOCKS)
    try:
        times = {n: host_us(lambda b=b: worker.wait(worker.push_many(b)[-1]), steps)
                 for n, b in chains.items()}
    finally:
        worker.stop(timeout=30)
    return (times[OPS] - times[SHORT_OPS]) / (OPS - SHORT_OPS)


def placements(sms: int, can_carve: bool):
    """(label, worker blocks, idle_poll_us, split: worker and GEMM on disjoint partitions
    (jitk.split_sms), SMs cuBLAS is told to leave free, 0 for none) for each way of running
    the worker beside the GEMM; the carve-out only where this torch has it."""
    rows = [(f"idle_poll_us={us}", BLOCKS, us, False, 0) for us in IDLE_POLLS_US]
    rows += [(f"{n} block{'s' * (n > 1)}", n, IDLE_POLLS_US[0], False, 0) for n in (1, 2)]
    rows.append((f"split: worker on {BLOCKS} SMs, GEMM on the other {sms - BLOCKS}", BLOCKS,
                 IDLE_POLLS_US[0], True, 0))
    if can_carve:
        rows.append((f"split, and cuBLAS told sm_carveout={BLOCKS}", BLOCKS, IDLE_POLLS_US[0],
                     True, BLOCKS))
    return rows


def on_stream(fn, stream):
    """fn, run with `stream` current."""
    def run():
        with torch.cuda.stream(stream):
            return fn()
    return run


def gated_us(fn, repeats: int = 20) -> float:
    """fn's median GPU time between CUDA events, each run enqueued behind a gate the host
    opens only after the end event is enqueued: a host thread that waits for the GIL (the
    busy worker's producer holds it) adds no idle time between the events."""
    gate = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    samples = []
    for k in range(1, repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        jitk.stream_wait_value(gate, k, op="geq")
        try:
            start.record()
            fn()
            end.record()
        finally:
            gate.fill_(k)  # opened whatever happened: the stream waits on it
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def gemm_beside_busy(measure, step) -> tuple[float, int]:
    """measure() (a GEMM's time) while a host thread keeps pushing chains; and how many ran."""
    running = threading.Event()
    running.set()
    chains = [0]

    def keep_busy():
        while running.is_set():
            step()
            chains[0] += 1

    busy = threading.Thread(target=keep_busy)
    busy.start()
    try:
        return measure(), chains[0]
    finally:
        running.clear()
        busy.join(timeout=60)


def synced(fn):
    def run():
        fn()
        torch.cuda.synchronize()
    return run


def in_rounds(rounds: int, measure: dict) -> dict[str, list[float]]:
    """{name: [one value a round]}: every round calls each measure in turn, so a drift of the
    GPU's clocks over the run reaches all of them alike."""
    values = {name: [] for name in measure}
    for _ in range(rounds):
        for name, fn in measure.items():
            values[name].append(fn())
    return values


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    steps, rounds = (30, 7) if args.quick else (100, 15)
    torch.manual_seed(0)
    x = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    bufs = [torch.empty_like(x) for _ in range(2)]
    a = torch.randn(GEMM, GEMM, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(GEMM, GEMM, device="cuda", dtype=torch.bfloat16)
    gemm = lambda: torch.mm(a, b)  # noqa: E731

    # Everything torch launches runs once before any worker starts.
    eager = eager_chain(x, w, bufs, OPS)
    for _ in range(3):
        eager()
        gemm()
    graph = captured_graph(eager, calls_per_graph=1)  # the 180 kernels of one step
    side = torch.cuda.Stream()  # for the spinning control kernel
    gated_us(gemm, repeats=3)  # the gate's and the GEMM's kernels

    worker = chain_worker(capacity=1024)
    items, _ = chain_items(x, w, bufs, OPS)
    batch = worker.prepare(items, chain=True)
    short = worker.prepare(items[:SHORT_OPS], chain=True)

    def pushed(prepared):
        return lambda: worker.wait(worker.push_many(prepared)[-1])

    def worker_steps() -> tuple[float, float]:
        """A round of the worker: started, warmed, its full and short chains timed, stopped
        (so that the graph's rounds run with no worker resident)."""
        worker.start(blocks=BLOCKS)
        try:
            for _ in range(5):
                pushed(batch)()
            return host_us(pushed(batch), steps), host_us(pushed(short), steps)
        finally:
            worker.stop(timeout=30)

    def graph_steps() -> float:
        for _ in range(5):
            synced(graph.replay)()
        return host_us(synced(graph.replay), steps)

    # Steps: the graph and the worker in alternating rounds, each warmed first.
    timed = in_rounds(rounds, {"graph": graph_steps, "worker": worker_steps})
    graph_steps = timed["graph"]
    full = [t[0] for t in timed["worker"]]
    ratios = [f / g for f, g in zip(full, graph_steps)]
    slopes = [(f - s) / (OPS - SHORT_OPS) for f, s in timed["worker"]]
    graph_us, batched_us = statistics.median(graph_steps), statistics.median(full)
    per_item = statistics.median(slopes)
    rows = [
        {"how": "(a) 180 eager launches", "step_us": host_us(synced(eager), steps),
         "events_us": median_us(eager, repeats=steps, warmup=0)},
        {"how": "(b) CUDA graph replay", "step_us": graph_us,
         "events_us": median_us(graph.replay, repeats=steps, warmup=0),
         "rounds": spread(graph_steps)},
        {"how": "(c) worker, one batched push", "step_us": batched_us, "rounds": spread(full)},
    ]

    worker.start(blocks=BLOCKS)
    try:
        def one_by_one():
            last = None
            for op, kwargs in items:
                last = worker.push(op, after=last, **kwargs)
            worker.wait(last)

        rows.append({"how": "(c) worker, one push per item",
                     "step_us": host_us(one_by_one, max(10, steps // 5))})
        push_only = []
        for _ in range(steps):
            start = time.perf_counter()
            t = worker.push("scale", x=x, y=bufs[0], factor=1.0)
            push_only.append((time.perf_counter() - start) * 1e6)
            worker.wait(t)
        push_us = statistics.median(push_only)
        # The host's share of a step: the batched push alone, and a wait that finds its item
        # already done.
        host_push, host_wait = [], []
        for _ in range(steps):
            start = time.perf_counter()
            last = worker.push_many(batch)[-1]
            host_push.append((time.perf_counter() - start) * 1e6)
            worker.wait(last)
            start = time.perf_counter()
            worker.wait(last)
            host_wait.append((time.perf_counter() - start) * 1e6)
    finally:
        worker.stop(timeout=30)
    empty_item = empty_item_us(steps)

    # The GEMM: alone and beside each thing in alternating rounds, each round's ratio against
    # its own "alone"; the median ratio is the slowdown.
    gemm_rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    split = jitk.split_sms(BLOCKS)
    carveout = getattr(torch._C, "_set_sm_carveout_experimental", None)
    whole = lambda: gated_us(gemm, repeats=GEMM_REPEATS)  # noqa: E731
    on_rest = on_stream(whole, split.rest)
    on_rest()  # cuBLAS's set-up for that stream

    def spun():
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(2e8))  # longer than the GEMMs below at the H100's clocks
        t = whole()
        side.synchronize()
        return t

    def beside_worker(blocks, idle_poll, on_split, busy):
        measure = on_rest if on_split else whole

        def run():
            worker.start(blocks=blocks, idle_poll_us=idle_poll,
                         stream=split.own if on_split else None)
            try:
                time.sleep(0.002)
                return gemm_beside_busy(measure, pushed(batch))[0] if busy else measure()
            finally:
                worker.stop(timeout=30)
        return run

    def add_rows(label, alone_fn, beside: dict, carved=0):
        if carved:
            carveout(carved)
        try:
            timed = in_rounds(rounds, {"alone": alone_fn, **beside})
        finally:
            if carved:
                carveout(None)
        alone = timed.pop("alone")
        gemm_rows.append({"gemm": f"alone, {label}", "ms": statistics.median(alone) / 1e3})
        for state, times in timed.items():
            ratios_here = [t / a - 1 for t, a in zip(times, alone)]
            gemm_rows.append({"gemm": f"beside {state}, {label}",
                              "ms": statistics.median(times) / 1e3,
                              "slowdown": statistics.median(ratios_here),
                              "rounds": f"{min(ratios_here):+.1%} to {max(ratios_here):+.1%}"})

    first_rows = []
    add_rows("whole GPU", whole, {"a 1-thread spin kernel": spun})
    for label, blocks, idle_poll, on_split, carved in placements(sms, carveout is not None):
        worker.start(blocks=blocks, idle_poll_us=idle_poll, stream=split.own if on_split else None)
        try:
            time.sleep(0.01)
            first_rows.append({"worker": label, "first_item_us": host_us(
                lambda: worker.wait(worker.push("scale", x=x, y=bufs[0], factor=1.0)), steps)})
        finally:
            worker.stop(timeout=30)
        add_rows(label, on_rest if on_split else whole,
                 {f"an idle worker of {blocks}": beside_worker(blocks, idle_poll, on_split, False),
                  f"a busy worker of {blocks}": beside_worker(blocks, idle_poll, on_split, True)},
                 carved)
    split.close()
    whole_alone = next(r["ms"] for r in gemm_rows if r["gemm"] == "alone, whole GPU")
    for row in gemm_rows:
        row["vs_whole_gpu"] = row["ms"] / whole_alone - 1

    for row in rows:
        row["per_op_us"] = row["step_us"] / OPS
        row["vs_graph"] = row["step_us"] / graph_us
    print(f"{device_name()}; chain of {OPS} ops on 1x{N} bf16; worker on {BLOCKS} blocks; "
          f"{rounds} rounds")
    print_table("Step time (host issue to host-visible end), median of the rounds' medians",
                rows, ["how", "step_us", "events_us", "per_op_us", "vs_graph", "rounds"])
    print_table(f"GEMM (bf16 {GEMM}^3; CUDA events behind a host-opened gate, median of "
                f"{GEMM_REPEATS} a round); slowdown: median over rounds against the GEMM alone "
                "in the same round", gemm_rows, ["gemm", "ms", "slowdown", "rounds",
                                                 "vs_whole_gpu"])
    print_table("First item: push() to wait() returning, median", first_rows,
                ["worker", "first_item_us"])
    print(f"\nper item (slope {SHORT_OPS}->{OPS} items): {per_item:.2f} us, rounds "
          f"{spread(slopes)} (goal <= {GOAL_ITEM_US}), of which the worker's own (an empty "
          f"op): {empty_item:.2f} us; push() of one item on the host {push_us:.1f} us")
    print(f"host share of a step: push_many() of the prepared chain "
          f"{statistics.median(host_push):.1f} us, wait() for a done item "
          f"{statistics.median(host_wait):.1f} us")
    print(f"batched step / graph replay: {statistics.median(ratios):.2f}, rounds "
          f"{spread(ratios)} (goal <= {GOAL_STEP_VS_GRAPH})")
    for state in ("idle", "busy"):
        best = min((r for r in gemm_rows if f"{state} worker of {BLOCKS}" in r["gemm"]),
                   key=lambda r: r["slowdown"])
        print(f"GEMM slowdown beside a {state} worker of {BLOCKS} blocks, best placement: "
              f"{best['slowdown']:+.1%} ({best['gemm']}; goal <= {GOAL_GEMM_SLOWDOWN:.0%})")
    write_json(args.json, {"device": device_name(), "steps": rows, "step_ratios": ratios,
                           "gemm": gemm_rows, "per_item_us": per_item, "slopes": slopes,
                           "empty_item_us": empty_item, "first_item": first_rows,
                           "push_us": push_us})


if __name__ == "__main__":
    main()
