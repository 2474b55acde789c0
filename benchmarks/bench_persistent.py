"""The persistent worker against launches and CUDA graphs (issue 21).

A step is a chain of 180 small ops on one row of 4096 bf16, each reading the previous output:
rmsnorm, scale, add in turn. It runs as
  (a) 180 eager launches (jitk.rmsnorm, torch.mul, torch.add with out=),
  (b) one CUDA graph of those 180 kernels, replayed,
  (c) 180 items pushed to a running worker on 8 SMs (jitk/csrc/persistent_chain.cuh): one
      batched push of a prepared chain per step, and one push per item.
Every step time runs from the host's issue to the host seeing the last result (a synchronize,
or the worker's completion counter), median over many steps; (a) and (b) also by CUDA events.
Per item: the slope between chains of 18 and 180 items (the op's own time included). First
item: one scale item, push to host-visible completion. Beside a bf16 GEMM (8192^3 on the rest
of the GPU): the GEMM's time alone, beside an idle worker, and beside one running chains.

Everything torch launches is run once before the worker starts: a kernel's first launch
under CUDA's lazy loading would wait for the resident worker (jitk.persistent's docstring).

    python benchmarks/bench_persistent.py [--quick] [--json PATH]
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
sys.path.insert(0, os.path.join(os.path.dirname(BENCH_DIR), "tests"))

import torch  # noqa: E402
from common import device_name, parse_args, print_table, write_json  # noqa: E402
from persistent_cases import chain_items, chain_worker, test_worker  # noqa: E402

import jitk  # noqa: E402
from jitk.timing import median_us  # noqa: E402

N, OPS, SHORT_OPS, BLOCKS = 4096, 180, 18, 8
GEMM = 8192
# Issue 21's goals (H100).
GOAL_STEP_VS_GRAPH = 0.5
GOAL_ITEM_US = 1.0
GOAL_GEMM_SLOWDOWN = 0.08
# An idle block's longest sleep between looks for work: the default, and longer ones.
IDLE_POLLS_US = (0.256, 8.0, 1000.0)


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


def placements(can_carve: bool):
    """(label, worker blocks, idle_poll_us, worker on a green context of its own, SMs cuBLAS
    is told to leave free, 0 for none) for each way of running the worker beside the GEMM."""
    rows = [(f"idle_poll_us={us}", BLOCKS, us, False, 0) for us in IDLE_POLLS_US]
    rows += [(f"{n} block{'s' * (n > 1)}", n, IDLE_POLLS_US[0], False, 0) for n in (1, 2)]
    rows.append(("green context", BLOCKS, IDLE_POLLS_US[-1], True, 0))
    if can_carve:
        for carve in (BLOCKS, 2 * BLOCKS):
            rows.append((f"sm_carveout={carve}", BLOCKS, IDLE_POLLS_US[-1], False, carve))
            rows.append((f"green context, sm_carveout={carve}", BLOCKS, IDLE_POLLS_US[-1], True,
                         carve))
    return rows


def green_stream(sms: int):
    """A stream of a CUDA green context of `sms` SMs (torch's), or None where torch has none."""
    green = getattr(getattr(torch.cuda, "green_contexts", None), "GreenContext", None)
    if green is None or not hasattr(green, "Stream"):
        print("no torch.cuda.green_contexts.GreenContext.Stream: green-context rows skipped")
        return None
    context = green.create(num_sms=sms, device_id=torch.cuda.current_device())
    stream = context.Stream()
    stream._jitk_green_context = context  # the context lives as long as its stream
    return stream


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


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    steps = 50 if args.quick else 300
    torch.manual_seed(0)
    x = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    bufs = [torch.empty_like(x) for _ in range(2)]
    a = torch.randn(GEMM, GEMM, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(GEMM, GEMM, device="cuda", dtype=torch.bfloat16)
    gemm = lambda: torch.mm(a, b)

    # (a), (b), and the GEMM alone, before the worker exists.
    eager = eager_chain(x, w, bufs, OPS)
    for _ in range(3):
        eager()
        gemm()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        eager()
    graph.replay()
    torch.cuda.synchronize()
    rows = [
        {"how": "(a) 180 eager launches", "step_us": host_us(synced(eager), steps),
         "events_us": median_us(eager, repeats=steps, warmup=0)},
        {"how": "(b) CUDA graph replay", "step_us": host_us(synced(graph.replay), steps),
         "events_us": median_us(graph.replay, repeats=steps, warmup=0)},
    ]
    gated_us(gemm, repeats=3)  # loads the gate's and the GEMM's kernels before any worker
    gemm_alone = gated_us(gemm)

    worker = chain_worker(capacity=1024)
    items, _ = chain_items(x, w, bufs, OPS)
    batch = worker.prepare(items, chain=True)
    short = worker.prepare(items[:SHORT_OPS], chain=True)

    def pushed(prepared):
        return lambda: worker.wait(worker.push_many(prepared)[-1])

    worker.start(blocks=BLOCKS)
    try:
        def one_by_one():
            last = None
            for op, kwargs in items:
                last = worker.push(op, after=last, **kwargs)
            worker.wait(last)

        for _ in range(10):
            pushed(batch)()
        batched_us = host_us(pushed(batch), steps)
        short_us = host_us(pushed(short), steps)
        rows.append({"how": "(c) worker, one batched push", "step_us": batched_us})
        rows.append({"how": "(c) worker, one push per item",
                     "step_us": host_us(one_by_one, max(10, steps // 5))})
        push_only = []
        for _ in range(steps):
            start = time.perf_counter()
            t = worker.push("scale", x=x, y=bufs[0], factor=1.0)
            push_only.append((time.perf_counter() - start) * 1e6)
            worker.wait(t)
        push_us = statistics.median(push_only)
        per_item = (batched_us - short_us) / (OPS - SHORT_OPS)
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

    carveout = getattr(torch._C, "_set_sm_carveout_experimental", None)
    gemm_rows = [{"gemm": f"bf16 {GEMM}^3 alone", "ms": gemm_alone / 1e3, "slowdown": 0.0}]
    if carveout is not None:  # cuBLAS told to leave the worker's SMs alone, no worker
        carveout(BLOCKS)
        carved = gated_us(gemm)
        carveout(None)
        gemm_rows.append({"gemm": f"alone, sm_carveout={BLOCKS} (no worker)",
                          "ms": carved / 1e3, "slowdown": carved / gemm_alone - 1})
    # Control: no worker, one thread spinning in a kernel on another stream for the GEMMs.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(2e9))  # about a second at the H100's clocks
    spun = gated_us(gemm)
    side.synchronize()
    gemm_rows.append({"gemm": "beside a 1-thread spin kernel (no worker)", "ms": spun / 1e3,
                      "slowdown": spun / gemm_alone - 1})
    first_rows = []
    for label, blocks, idle_poll, green, carved in placements(carveout is not None):
        stream = green_stream(BLOCKS) if green else None
        if green and stream is None:
            continue
        worker.start(blocks=blocks, idle_poll_us=idle_poll, stream=stream)
        try:
            if carved:
                carveout(carved)
            time.sleep(0.01)
            first = host_us(lambda: worker.wait(worker.push("scale", x=x, y=bufs[0],
                                                              factor=1.0)), steps)
            first_rows.append({"worker": label, "first_item_us": first})
            idle = gated_us(gemm)
            busy, chains = gemm_beside_busy(lambda: gated_us(gemm), pushed(batch))
        finally:
            if carved:
                carveout(None)
            worker.stop(timeout=30)
        gemm_rows.append({"gemm": f"beside an idle worker, {label}", "ms": idle / 1e3,
                          "slowdown": idle / gemm_alone - 1})
        gemm_rows.append({"gemm": f"beside a busy worker ({chains} chains), {label}",
                          "ms": busy / 1e3, "slowdown": busy / gemm_alone - 1})

    # The placement: the worker on a green context of BLOCKS SMs, the GEMM on one of
    # the other SMs; slowdowns against that GEMM alone there (and its cost against the whole).
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rest, mine = green_stream(sms - BLOCKS), green_stream(BLOCKS)
    if rest is not None:
        rest_gemm = on_stream(lambda: gated_us(gemm), rest)
        on_stream(lambda: gated_us(gemm, repeats=3), rest)()  # cuBLAS's set-up on that stream
        rest_alone = rest_gemm()
        worker.start(blocks=BLOCKS, stream=mine)
        try:
            idle = rest_gemm()
            busy, chains = gemm_beside_busy(rest_gemm, pushed(batch))
        finally:
            worker.stop(timeout=30)
        label = f"GEMM on a green context of the other {sms - BLOCKS} SMs"
        gemm_rows.append({"gemm": f"{label}, alone (vs the whole GPU)", "ms": rest_alone / 1e3,
                          "slowdown": rest_alone / gemm_alone - 1})
        gemm_rows.append({"gemm": f"{label}, beside an idle worker (vs alone there)",
                          "ms": idle / 1e3, "slowdown": idle / rest_alone - 1})
        gemm_rows.append({"gemm": f"{label}, beside a busy worker ({chains} chains; vs alone "
                                  "there)", "ms": busy / 1e3, "slowdown": busy / rest_alone - 1})

    graph_us = rows[1]["step_us"]
    for row in rows:
        row["per_op_us"] = row["step_us"] / OPS
        row["vs_graph"] = row["step_us"] / graph_us
    print(f"{device_name()}; chain of {OPS} ops on 1x{N} bf16; worker on {BLOCKS} blocks")
    print_table("Step time (host issue to host-visible end), median", rows,
                ["how", "step_us", "events_us", "per_op_us", "vs_graph"])
    print_table("GEMM beside the worker (CUDA events behind a host-opened gate, median of 20)",
                gemm_rows,
                ["gemm", "ms", "slowdown"])
    print_table("First item: push() to wait() returning, median", first_rows,
                ["worker", "first_item_us"])
    print(f"\nper item (slope {SHORT_OPS}->{OPS} items): {per_item:.2f} us "
          f"(goal <= {GOAL_ITEM_US}), of which the worker's own (an empty op): "
          f"{empty_item:.2f} us; push() of one item on the host {push_us:.1f} us")
    print(f"host share of a step: push_many() of the prepared chain "
          f"{statistics.median(host_push):.1f} us, wait() for a done item "
          f"{statistics.median(host_wait):.1f} us")
    print(f"batched step / graph replay: {batched_us / graph_us:.2f} (goal <= "
          f"{GOAL_STEP_VS_GRAPH})")
    for state in ("idle", "busy"):
        best = min((r for r in gemm_rows if f"{state} worker" in r["gemm"]),
                   key=lambda r: r["slowdown"])
        print(f"GEMM slowdown beside a {state} worker, best placement: {best['slowdown']:+.1%} "
              f"({best['gemm']}; goal <= {GOAL_GEMM_SLOWDOWN:.0%})")
    write_json(args.json, {"device": device_name(), "steps": rows, "gemm": gemm_rows,
                           "per_item_us": per_item, "empty_item_us": empty_item,
                           "first_item": first_rows, "push_us": push_us})


if __name__ == "__main__":
    main()
