"""GPU timing with CUDA events, shared by the demo, the autotuner and the benchmarks."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def median_us(fn: Callable[[], object], repeats: int = 20, warmup: int = 3) -> float:
    """Median microseconds of `fn` on the current stream, events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def captured_graph(fn: Callable[[], object], calls_per_graph: int = 100) -> torch.cuda.CUDAGraph:
    """A CUDA graph of calls_per_graph calls of fn, warmed up on a side stream, replayed once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph
