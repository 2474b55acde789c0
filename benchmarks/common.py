"""Timing and reporting shared by the benchmark scripts.

Every figure is a median over repeated runs after warm-up, taken with CUDA events (through
triton.testing.do_bench when Triton is installed). Ceilings are measured in the same run, so
ratios compare like with like."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from jitk.tools.timing import captured_graph, median_us


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--quick", action="store_true", help="fewer shapes, shorter runs")
    return parser.parse_args()


def device_name() -> str:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return f"{props.name} ({props.multi_processor_count} SMs, torch {torch.__version__})"


def time_us(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median microseconds per call, events around each call."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3
    return median_us(fn, repeats=50, warmup=10)


def time_graph_us(fn: Callable[[], object], calls_per_graph: int = 100, replays: int = 20) -> float:
    """Median microseconds per call under CUDA graph replay: launch gaps shrink to what the
    GPU itself needs, which is what a serving engine's decode step sees."""
    graph = captured_graph(fn, calls_per_graph)
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls_per_graph)
    return statistics.median(samples)


def device_copy_gbps(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src))
    return 2 * nbytes / us / 1e3


def pinned_copy_gbps(nbytes: int = 256 << 20) -> tuple[float, float]:
    """(host->device, device->host) bandwidth through pinned memory."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).random_()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = nbytes / time_us(lambda: dev.copy_(host, non_blocking=True)) / 1e3
    d2h = nbytes / time_us(lambda: host.copy_(dev, non_blocking=True)) / 1e3
    return h2d, d2h


def print_table(title: str, rows: Sequence[dict], columns: Sequence[str]) -> None:
    print(f"\n{title}")
    cells = [[_fmt(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c)
              for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)


def host_us_per_call(fn: Callable[[], object], calls: int = 2000, rounds: int = 5) -> float:
    """Host time per call, best of `rounds`: launches only, the GPU drained before each."""
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return best
