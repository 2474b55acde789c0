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


def trimmed_mean(samples: list[float], cut: float = 0.1) -> float:
    """The mean of `samples` less the `cut` fraction at each end. For single calls from an
    idle GPU, whose times fall at two levels (in steps of the global timer's resolution), the
    median lands on one level or the other; this weighs how often each occurs,
    while the rare stalls at either end drop out."""
    if not samples or not 0 <= cut < 0.5:
        raise ValueError(f"trimmed_mean: needs samples and 0 <= cut < 0.5, got "
                         f"{len(samples)} samples and cut={cut!r}")
    ordered = sorted(samples)
    drop = int(len(ordered) * cut)
    return statistics.fmean(ordered[drop:len(ordered) - drop])


def gemm_neighbour(rows: int, dtype: torch.dtype,
                   device: torch.device | str = "cuda") -> Callable[[], object]:
    """A GEMM of rows x 2048 by 2048 x 2048 on tensors of its own, as a model's projection
    runs before its norm: what the tuner (beside=True) and the benchmarks time a norm after."""
    rows = max(rows, 1)
    a, b = (torch.randn(n, 2048, device=device, dtype=dtype) for n in (rows, 2048))
    out = torch.empty(rows, 2048, device=device, dtype=dtype)
    return lambda: torch.mm(a, b, out=out)


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
