"""How bench_hicache.py times a call: layers issued on side streams, alone and beside the
GEMMs on the current stream, and alone against a same-size copy_ taken alternately."""

from __future__ import annotations

import math
import statistics

import common
import torch
from hicache_calls import INDEX_SETS, MIB, same_size_copy

GEMM = (12, 8192)


def run_layers(calls, layers: int, streams: list, gemm=None) -> tuple[list[float], float]:
    """Issues `layers` calls round-robin over `streams` (after the GEMMs, if any, on the
    current stream); returns each layer's end and the GEMMs' end, in ms from the start."""
    main = torch.cuda.current_stream()
    start = torch.cuda.Event(enable_timing=True)
    gemm_end = torch.cuda.Event(enable_timing=True)
    start.record(main)
    if gemm is not None:
        gemm()
    gemm_end.record(main)
    ends = []
    for i in range(layers):
        stream = streams[i % len(streams)]
        if i < len(streams):
            stream.wait_event(start)
        with torch.cuda.stream(stream):
            calls[i % len(calls)]()
        ends.append(torch.cuda.Event(enable_timing=True))
        ends[-1].record(stream)
    for stream in streams:
        main.wait_stream(stream)
    torch.cuda.synchronize()
    return [start.elapsed_time(e) for e in ends], start.elapsed_time(gemm_end)


def make_gemm():
    count, n = GEMM
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    return lambda: [torch.matmul(a, b, out=c) for _ in range(count)]


def gemm_alone_ms(gemm) -> float:
    """After a second of GEMMs, so that clocks have settled."""
    samples = [run_layers([], 0, [], gemm)[1] for _ in range(60)]
    return statistics.median(samples[-5:])


def overlap_row(label, calls, layer_bytes, streams, gemm, gemm_ms, rounds) -> dict:
    """Alone, then beside the GEMMs: enough layers to outlast them at the solo rate. The
    GEMMs are timed alone between the rounds (clocks drift over a run)."""
    for call in calls:
        call()  # build, load, first touch
    probe = max(2, min(64, math.ceil(4 * MIB * 16 / layer_bytes)))
    ends, _ = run_layers(calls, probe, streams)
    alone_gbps = probe * layer_bytes / ends[-1] / 1e6
    layers = max(4, min(2000, math.ceil(1.3 * gemm_ms * alone_gbps * 1e6 / layer_bytes)))
    ends, _ = run_layers(calls, layers, streams)
    alone_gbps = layers * layer_bytes / max(ends) / 1e6
    beside, with_transfer, alone = [], [], []
    for _ in range(rounds):
        alone.append(run_layers([], 0, streams, gemm)[1])
        ends, gemm_end = run_layers(calls, layers, streams, gemm)
        done = [t for t in ends if t <= gemm_end]
        if done:  # none when one layer outlasts the GEMMs
            beside.append(len(done) * layer_bytes / max(done) / 1e6)
        with_transfer.append(gemm_end)
    gemm_alone = statistics.median(alone)
    return {"method": label, "gemm ms": gemm_alone, "alone GB/s": alone_gbps,
            "beside GB/s": statistics.median(beside) if beside else "n/a",
            "GEMM slowdown": statistics.median(with_transfer) / gemm_alone - 1,
            "layers": layers}


def guarded_row(label, calls, layer_bytes, streams, gemm, gemm_ms, rounds) -> dict:
    try:
        return overlap_row(label, calls, layer_bytes, streams, gemm, gemm_ms, rounds)
    except RuntimeError as error:  # one failed method must not end the run
        return {"method": label, "error": str(error)[:300]}


def timed_against_copy(direction, moved, call, timing, rounds=3):
    """(jitk us, same-size copy us), each the median of rounds taken alternately: PCIe
    bandwidth drifts by a few percent between measurements."""
    copy_call = same_size_copy(direction, moved)
    jitk, copy = [], []
    for _ in range(rounds):
        copy.append(common.time_us(copy_call, **timing))
        jitk.append(common.time_us(call, **timing))
    return statistics.median(jitk), statistics.median(copy)


def solo_row(direction, tokens, row_bytes, page, pool, method, call, device_copy, timing):
    moved = 2 * tokens * row_bytes
    for _ in range(INDEX_SETS):
        call()
    jitk_us, copy_us = timed_against_copy(direction, moved, call, timing)
    counted = 2 * moved if direction == "d2d" else moved
    gbps, copy_gbps = counted / jitk_us / 1e3, counted / copy_us / 1e3
    ceiling = device_copy if direction == "d2d" else copy_gbps
    return {"direction": direction, "tokens": tokens, "bytes/token": row_bytes, "page": page,
            "pool": pool, "method": method, "jitk us": jitk_us, "jitk GB/s": gbps,
            "ceiling GB/s": ceiling, "ratio": gbps / ceiling, "same-size copy GB/s": copy_gbps,
            "vs same-size copy": gbps / copy_gbps}
