"""GPU timing with CUDA events, shared by the demo and the benchmarks."""

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
