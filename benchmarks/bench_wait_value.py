"""Stream wait / write value: wake-up latency against torch.cuda.Event, the host round trip
through pinned flags, and what a wait costs when it does not wait.

Wake-up latency: stream A runs a sleep kernel, so stream B's wait is already in place when A
signals; the figure runs from an event recorded on A just before the signal to one recorded
on B after a one-element kernel behind the wait.

    python benchmarks/bench_wait_value.py [--quick] [--json PATH]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from common import (  # noqa: E402
    device_name, parse_args, print_table, time_graph_us, time_us, write_json,
)

from jitk.wait_value import Event, stream_wait_value, stream_write_value  # noqa: E402

SLEEP_CYCLES = 200_000  # ~100 us: B's wait is enqueued and spinning before A signals
WARMUP = 10


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def wake_up_us(signal: Callable[[int], None], wait: Callable[[int], None],
               iterations: int) -> list[float]:
    """A: sleep, start event, signal(i). B: wait(i), a one-element kernel, end event. A is
    enqueued first, so B's wait never sits ahead of A's signal in a shared hardware queue."""
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.zeros(1, device="cuda")
    samples = []
    for i in range(1, WARMUP + iterations + 1):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(a):
            torch.cuda._sleep(SLEEP_CYCLES)
            start.record()
            signal(i)
        with torch.cuda.stream(b):
            wait(i)
            x.add_(1)
            end.record()
        end.synchronize()
        if i > WARMUP:
            samples.append(start.elapsed_time(end) * 1e3)
    return samples


def same_stream_us(iterations: int) -> list[float]:
    """The floor: the one-element kernel right behind the start event on one stream."""
    stream = torch.cuda.Stream()
    x = torch.zeros(1, device="cuda")
    samples = []
    for i in range(WARMUP + iterations):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            start.record()
            x.add_(1)
            end.record()
        end.synchronize()
        if i >= WARMUP:
            samples.append(start.elapsed_time(end) * 1e3)
    return samples


def latency_rows(iterations: int) -> list[dict]:
    torch_event = torch.cuda.Event()
    device_flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    host_flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    cases = {
        "same stream (floor)": lambda: same_stream_us(iterations),
        "torch.cuda.Event record/wait": lambda: wake_up_us(
            lambda i: torch_event.record(),
            lambda i: torch.cuda.current_stream().wait_event(torch_event), iterations),
        "jitk write/wait, cuda flag": lambda: wake_up_us(
            lambda i: stream_write_value(device_flag, i),
            lambda i: stream_wait_value(device_flag, i), iterations),
        "jitk write/wait, pinned flag": lambda: wake_up_us(
            lambda i: stream_write_value(host_flag, i),
            lambda i: stream_wait_value(host_flag, i), iterations),
    }
    rows = []
    for name, measure in cases.items():
        samples = measure()
        rows.append({"table": "wake-up", "method": name,
                     "median_us": statistics.median(samples),
                     "p10_us": percentile(samples, 0.1), "p90_us": percentile(samples, 0.9)})
    return rows


def jitk_host_round_trip_us(iterations: int) -> list[float]:
    """The host sets ping to i; the stream, waiting for it, writes pong = i; the host polls."""
    ping, pong = Event(host=True), Event(host=True)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(1, iterations + 1):
            ping.wait(i)
            pong.record(i)
    samples = []
    released = 0
    try:
        for i in range(1, iterations + 1):
            started = time.perf_counter()
            ping.set(i)
            released = i
            while not pong.query(i):
                if time.perf_counter() - started > 1.0:
                    raise RuntimeError(f"round {i}: the stream never answered")
            samples.append((time.perf_counter() - started) * 1e6)
    finally:
        for value in range(released + 1, iterations + 1):  # never leave a wait behind
            ping.set(value)
            time.sleep(1e-3)
        stream.synchronize()
    return samples[WARMUP:]


def torch_launch_round_trip_us(iterations: int) -> list[float]:
    """The nearest PyTorch equivalent: launch a one-element kernel, poll its event."""
    x = torch.zeros(1, device="cuda")
    done = torch.cuda.Event()
    samples = []
    for _ in range(iterations):
        started = time.perf_counter()
        x.add_(1)
        done.record()
        while not done.query():
            pass
        samples.append((time.perf_counter() - started) * 1e6)
    return samples[WARMUP:]


def round_trip_rows(iterations: int) -> list[dict]:
    cases = {
        "jitk pinned ping -> stream -> pinned pong": jitk_host_round_trip_us,
        "torch launch + event poll": torch_launch_round_trip_us,
    }
    rows = []
    for name, measure in cases.items():
        samples = measure(WARMUP + iterations)
        rows.append({"table": "round trip", "method": name,
                     "median_us": statistics.median(samples),
                     "p10_us": percentile(samples, 0.1), "p90_us": percentile(samples, 0.9)})
    return rows


def host_us_per_call(fn: Callable[[], object], calls: int = 500) -> float:
    """Python-side cost of enqueuing: few enough calls that the launch queue never fills."""
    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - started
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def unblocked_rows(quick: bool) -> list[dict]:
    device_flag = torch.ones(1, dtype=torch.int32, device="cuda")
    host_flag = torch.ones(1, dtype=torch.int32, pin_memory=True)
    scratch = torch.zeros(1, dtype=torch.int32, device="cuda")
    x = torch.zeros(1, device="cuda")
    finished = torch.cuda.Event()
    finished.record()
    cases = {
        "jitk wait, cuda flag": (lambda: stream_wait_value(device_flag, 1), True),
        "jitk wait, pinned flag": (lambda: stream_wait_value(host_flag, 1), True),
        "jitk write, cuda flag": (lambda: stream_write_value(scratch, 1), True),
        "torch wait_event (done)": (
            lambda: torch.cuda.current_stream().wait_event(finished), False),
        "torch one-element add_": (lambda: x.add_(1), True),
    }
    rep_ms = 30 if quick else 100
    rows = []
    for name, (fn, capturable) in cases.items():
        rows.append({
            "table": "unblocked", "op": name,
            "host_us": host_us_per_call(fn),
            "eager_us": time_us(fn, warmup_ms=10, rep_ms=rep_ms),
            # An event recorded outside a capture cannot be waited on inside it.
            "graph_us": time_graph_us(fn) if capturable else "n/a",
        })
    return rows


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    iterations = 50 if args.quick else 500
    print(f"device: {device_name()}")
    latency = latency_rows(iterations)
    print_table("wake-up latency: A signals, B's next kernel is done (us)", latency,
                ["method", "median_us", "p10_us", "p90_us"])
    round_trip = round_trip_rows(iterations)
    print_table("host -> GPU -> host round trip, host clock (us)", round_trip,
                ["method", "median_us", "p10_us", "p90_us"])
    unblocked = unblocked_rows(args.quick)
    print_table("a wait that does not wait, per call (us)", unblocked,
                ["op", "host_us", "eager_us", "graph_us"])

    by_method = {row["method"]: row["median_us"] for row in latency}
    by_op = {row["op"]: row for row in unblocked}
    summary = [
        {"figure": "wake-up, jitk cuda flag / torch event",
         "value": by_method["jitk write/wait, cuda flag"]
         / by_method["torch.cuda.Event record/wait"]},
        {"figure": "wake-up, jitk cuda flag (us)",
         "value": by_method["jitk write/wait, cuda flag"]},
        {"figure": "unblocked wait in a graph (us)",
         "value": by_op["jitk wait, cuda flag"]["graph_us"]},
        {"figure": "one-element kernel in a graph (us)",
         "value": by_op["torch one-element add_"]["graph_us"]},
    ]
    print_table("summary", summary, ["figure", "value"])
    write_json(args.json, {"benchmark": "wait_value", "device": device_name(),
                           "rows": latency + round_trip + unblocked + summary})


if __name__ == "__main__":
    main()
