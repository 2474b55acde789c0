"""Experiment (issue #17, point 4): pages of 1 and 16 tokens x 1 KiB (K+V, one layer call)
beside a saturating GEMM (12 x bf16 8192^3 on the main stream), through the pipelines of
exp_hicache_pipeline.cuh (CPU threads gather/scatter host pages into pinned chunks, the copy
engines move the chunks, a GPU kernel scatters/gathers device pages), and what caps them:

1. host ceilings: a contiguous copy between pinned 256 MiB buffers by 1..16 threads, and a
   gather of random 1 KiB / 16 KiB pieces by 8 / 16 threads, alone and while a full-speed
   H2D copy reads the same DRAM;
2. the GEMM's time while 1-8 blocks stay resident (a stand-in for a resident transfer
   kernel), light or filling their SM;
3. the device half alone (one d2d page gather/scatter launch of K and V) beside the GEMM,
   by call size: SM work beside the GEMM waits for SMs once per launch;
4. the pipelines (per-chunk or one device launch, chunk size), alone and beside the GEMM,
   and a split (a share of the pages by jitk's SM kernel on a second stream at once); with
   --in-cache also "per-thread streams" (one pool run a call: each CPU thread gathers or
   scatters its own chunks through its own pinned slots and copies them on its own stream);
5. the references: jitk's kernel by block quota, the copy engines on 1 / 2 / 4 streams at
   pages of 16, a contiguous copy_.
Each pipeline is checked exact once against torch (poisoned destination). "call ms" is one
call alone (median, synchronized); --json writes the rows. --build-only builds and exits.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import torch

import bench_hicache as bench  # noqa: E402
import common  # noqa: E402
import hicache_calls  # noqa: E402
import hicache_timing  # noqa: E402

from jitk import load_jit
from jitk.kernels import hicache  # noqa: E402

ROW = 1024  # bytes per token per layer, K and V each
MIB = 1 << 20
SLOTS = 4  # pinned staging chunks in flight (per CPU thread with per-thread streams)
BLOCKS = 16  # blocks of the device half
LANES = 15  # the most CPU threads of a per-thread-streams pipeline
LANE_CHUNK = 2 * MIB  # its largest chunk


@functools.cache
def module():
    names = ("load_back", "write_back", "load_back_streams", "write_back_streams",
             "device_half", "hold_sms", "host_copy_gbps", "host_gather_gbps")
    return load_jit("exp_hicache_pipeline",
                    cuda_files=[os.path.join(os.path.dirname(__file__),
                                             "exp_hicache_pipeline.cuh")],
                    cuda_wrappers=[(n, f"jitk::exp_pipeline::Pipeline::{n}") for n in names])


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


class Staging:
    """Pinned chunks and a device staging area, sized for the largest call: SLOTS x K+V
    chunks of `chunk_bytes` shared, or as many per thread for LANES threads of per-thread
    streams at chunks of LANE_CHUNK (15 x 4 x 2 x 2 MiB = 240 MiB pinned), the same memory."""

    def __init__(self, max_bytes: int, chunk_bytes: int):
        self.host = torch.empty(SLOTS * 2 * max(chunk_bytes, LANES * LANE_CHUNK),
                                dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty(4 * max_bytes, dtype=torch.uint8, device="cuda")  # 2 halves


def pipeline_calls(pools, direction: str, tokens: int, page: int, threads: int,
                   chunk_bytes: int, one_launch: bool, staging: Staging, share: float = 0.0,
                   blocks: int = BLOCKS, non_temporal: bool = True, streams: bool = False):
    """One call per index set: a layer's K+V by the pipeline; with `share` > 0 that share
    of the pages goes by jitk's SM kernel on a second stream at the same time.
    `non_temporal`: the CPU's stores (the load-back's gather into staging, the write-back's
    scatter into the host pool) bypass the caches. `streams`: the per-thread-streams
    pipeline (one device launch a call; `one_launch` is ignored)."""
    piece = page * ROW
    entry = pipeline_entry(direction, streams, one_launch)
    side = torch.cuda.Stream()
    split = int(round(share * tokens / page)) * page  # whole pages
    calls = []
    for _ in range(hicache_calls.INDEX_SETS):
        host_tokens = hicache_calls.page_indices(tokens, hicache_calls.HOST_POOL, page)
        gpu_tokens = hicache_calls.page_indices(tokens, hicache_calls.GPU_POOL, page)
        dst, src = pools.sides(direction)
        kernel_dst, kernel_src = ((gpu_tokens, host_tokens) if direction == "h2d" else
                                  (host_tokens, gpu_tokens))
        kernel = functools.partial(hicache.transfer_hicache_one_layer, dst[0], dst[1],
                                   kernel_dst[:split].cuda(), src[0], src[1],
                                   kernel_src[:split].cuda(), method="kernel")
        pipeline = functools.partial(
            entry, flat(pools.host[0]), flat(pools.host[1]), host_tokens[split:][::page].clone(),
            flat(pools.gpu[0]), flat(pools.gpu[1]), gpu_tokens[split:][::page].cuda(),
            staging.host, staging.dev, 2, ROW, page, max(1, chunk_bytes // piece), SLOTS,
            threads, blocks, non_temporal)
        calls.append(functools.partial(split_call, kernel if split else None,
                                       pipeline if split < tokens else None, side))
    return calls


def pipeline_entry(direction: str, streams: bool, one_launch: bool):
    """The module's entry for a direction, its last argument (one_launch) bound."""
    if streams:
        return module().load_back_streams if direction == "h2d" else module().write_back_streams
    entry = module().load_back if direction == "h2d" else module().write_back
    return lambda *args: entry(*args, one_launch)


def split_call(kernel, pipeline, side: torch.cuda.Stream) -> None:
    """The kernel's share on `side`, the pipeline's on the current stream, at once."""
    main = torch.cuda.current_stream()
    if kernel is not None:
        side.wait_stream(main)
        with torch.cuda.stream(side):
            kernel()
    if pipeline is not None:
        pipeline()
    if kernel is not None:
        main.wait_stream(side)


def check(pools, direction: str, page: int, staging: Staging, one_launch: bool,
          non_temporal: bool, streams: bool = False) -> None:
    """One pipeline call on fresh indices against torch, destination poisoned. Per-thread
    streams take chunks of 64 KiB, so that each of the 3 threads goes round its ring of
    SLOTS slots more than once."""
    tokens = 2048
    host_tokens = hicache_calls.page_indices(tokens, hicache_calls.HOST_POOL, page)
    gpu_tokens = hicache_calls.page_indices(tokens, hicache_calls.GPU_POOL, page).cuda()
    dst, src = pools.sides(direction)
    i_dst, i_src = (gpu_tokens, host_tokens) if direction == "h2d" else (host_tokens, gpu_tokens)
    for d in dst:
        d.index_fill_(0, i_dst.to(d.device), float("nan"))
    torch.cuda.synchronize()  # the one-launch load-back's streams do not wait for this one
    chunk = (64 if streams else 256) * 1024
    entry = pipeline_entry(direction, streams, one_launch)
    entry(flat(pools.host[0]), flat(pools.host[1]), host_tokens[::page].contiguous(),
          flat(pools.gpu[0]), flat(pools.gpu[1]), gpu_tokens[::page].contiguous(), staging.host,
          staging.dev, 2, ROW, page, max(1, chunk // (page * ROW)), SLOTS, 3, BLOCKS,
          non_temporal)
    torch.cuda.synchronize()
    for d, s in zip(dst, src):
        got, want = d[i_dst.to(d.device)], s[i_src.to(s.device)]
        if not torch.equal(got.cpu(), want.cpu()):
            variant = ("per-thread streams" if streams else f"one launch: {one_launch}")
            raise AssertionError(f"pipeline {direction} page {page} ({variant}, "
                                 f"non-temporal: {non_temporal}): rows differ")


@functools.cache
def h2d_buffers(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(size, dtype=torch.uint8, pin_memory=True).fill_(2),
            torch.empty(size, dtype=torch.uint8, device="cuda"))


def beside_h2d(measure, size: int) -> tuple[float | str, float]:
    """(median of measure() while 16 H2D copies of `size` bytes run, their GB/s)."""
    src, dst = h2d_buffers(size)
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    for _ in range(16):
        dst.copy_(src, non_blocking=True)
    end.record()
    found = []
    while not end.query():
        found.append(measure())
    end.synchronize()
    return (statistics.median(found) if found else "n/a",
            16 * size / (start.elapsed_time(end) * 1e6))


def host_ceilings(rows: list, pools) -> None:
    """Pinned host memory: contiguous copies by 1..16 threads, gathers of random pieces by 8
    and 16 threads, alone and beside a full-speed H2D copy."""
    size = 256 * MIB
    a, b = (torch.empty(size, dtype=torch.uint8, pin_memory=True).fill_(1) for _ in range(2))
    for threads in (1, 2, 4, 8, 16):
        for nt in (False, True):
            copy = functools.partial(module().host_copy_gbps, b, a, threads, 1, nt)
            copy()
            alone = statistics.median(copy() for _ in range(4))
            beside, dma = beside_h2d(copy, size)
            rows.append({"work": "contiguous copy", "threads": threads, "non-temporal": nt,
                         "alone GB/s": alone, "beside H2D GB/s": beside, "H2D GB/s": dma})
            print("  ", bench._short(rows[-1]), flush=True)
    for page in (1, 16):
        idx = hicache_calls.page_indices(32768, hicache_calls.HOST_POOL, page)[::page].contiguous()
        for threads in (8, 16):
            gather = functools.partial(module().host_gather_gbps, b, flat(pools.host[0]), idx,
                                       page * ROW, ROW, threads, 1, True)
            gather()
            alone = statistics.median(gather() for _ in range(8))
            beside, dma = beside_h2d(gather, size)
            rows.append({"work": f"gather of {page} KiB pieces", "threads": threads,
                         "non-temporal": True, "alone GB/s": alone, "beside H2D GB/s": beside,
                         "H2D GB/s": dma})
            print("  ", bench._short(rows[-1]), flush=True)


def resident_slowdown(rows: list, gemm, gemm_ms: float) -> None:
    """The GEMMs' time while `blocks` blocks stay resident from before they start."""
    probe = torch.empty(1, device="cuda")
    side = torch.cuda.Stream()
    for blocks in (1, 4, 8):
        for heavy in (False, True):
            times = []
            for _ in range(5):
                torch.cuda.synchronize()
                with torch.cuda.stream(side):
                    module().hold_sms(probe, blocks, int(2.5 * gemm_ms * 1e6), heavy)
                time.sleep(0.002)  # resident before the GEMMs are issued
                times.append(hicache_timing.run_layers([], 0, [], gemm)[1])
                torch.cuda.synchronize()
            ms = statistics.median(times)
            rows.append({"blocks": blocks, "fill the SM": heavy, "gemm ms": ms,
                         "GEMM slowdown": ms / gemm_ms - 1})
            print("  ", bench._short(rows[-1]), flush=True)


def device_half_calls(pools, direction: str, tokens: int, page: int, staging: Staging,
                      blocks: int = BLOCKS):
    calls = []
    for _ in range(hicache_calls.INDEX_SETS):
        idx = hicache_calls.page_indices(tokens, hicache_calls.GPU_POOL, page)[::page].cuda()
        calls.append(functools.partial(module().device_half, staging.dev, flat(pools.gpu[0]),
                                       flat(pools.gpu[1]), idx, ROW, page, blocks,
                                       direction == "d2h"))
    return calls


def multi_stream_calls(pools, direction: str, tokens: int, page: int, streams: int):
    """The copy engines with the pages split over `streams` streams at once."""
    sides = [torch.cuda.Stream() for _ in range(streams)]
    variant = hicache_calls.Variant("copy_engine", "copy_engine", host_indices=True)
    parts = [hicache_calls.layer_calls(variant, pools, direction, tokens // streams, page)
             for _ in range(streams)]

    def call(i):
        main = torch.cuda.current_stream()
        for side, part in zip(sides, parts):
            side.wait_stream(main)
            with torch.cuda.stream(side):
                part[i]()
        for side in sides:
            main.wait_stream(side)
    return [functools.partial(call, i) for i in range(hicache_calls.INDEX_SETS)]


def latency_ms(calls) -> float:
    """One call alone, median of 20, ms (a synchronize after each)."""
    samples = []
    for i in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        calls[i % len(calls)]()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def in_cache_rows(pools, staging: Staging, direction: str) -> list:
    """The one-launch pipeline with its staging kept in the CPU's caches: chunks small enough
    (SLOTS x K+V of them in flight) that the DMA reads what the gather just stored, or the
    scatter reads what the DMA just wrote, from the last-level cache; the load-back's gather
    stores through the caches, the write-back's scatter into the pool still bypasses them.
    Against the 4 MiB non-temporal rows of todo_rows, a byte would cross DRAM once, not twice;
    a contiguous copy_ of the same bytes is the ceiling, in the same run."""
    todo = [(65536, 1, "copy_ contiguous",
             hicache_calls.contiguous_calls(pools, direction, 65536), 0)]
    for tokens, page in ((65536, 1), (65536, 16)):
        todo.append((tokens, page, "pipeline 1 launch, 4 MiB chunks",
                     pipeline_calls(pools, direction, tokens, page, 15, 4 * MIB, True,
                                    staging), 15))
        for chunk in (MIB // 2, MIB, 2 * MIB):
            for threads in (8, 15):
                todo.append((tokens, page, f"in cache: {chunk // 1024} KiB chunks",
                             pipeline_calls(pools, direction, tokens, page, threads, chunk,
                                            True, staging, non_temporal=direction == "d2h"),
                             threads))
        for chunk in (MIB // 2, MIB, 2 * MIB):  # no fork-join per chunk
            for threads in (8, 15):
                todo.append((tokens, page, f"per-thread streams, {chunk // 1024} KiB chunks",
                             pipeline_calls(pools, direction, tokens, page, threads, chunk,
                                            False, staging, non_temporal=direction == "d2h",
                                            streams=True), threads))
    return todo


def todo_rows(pools, staging: Staging, direction: str) -> list:
    """(tokens, page, label, calls, CPU threads) of every measured path for a direction."""
    todo = []
    for tokens in (4096, 16384, 32768, 65536):
        for blocks in (BLOCKS, 132) if tokens >= 32768 else (BLOCKS,):
            todo.append((tokens, 1, f"device half alone (1 launch, {blocks} blocks)",
                         device_half_calls(pools, direction, tokens, 1, staging, blocks), 0))
    for tokens, page in ((32768, 1), (32768, 16), (65536, 1), (65536, 16)):
        for chunk in (4 * MIB, 8 * MIB):
            todo.append((tokens, page, f"pipeline 1 launch, {chunk // MIB} MiB chunks",
                         pipeline_calls(pools, direction, tokens, page, 15, chunk, True,
                                        staging), 15))
        todo.append((tokens, page, "pipeline 1 launch of 132 blocks, 4 MiB chunks",
                     pipeline_calls(pools, direction, tokens, page, 15, 4 * MIB, True, staging,
                                    blocks=132), 15))
        todo.append((tokens, page, "pipeline per chunk, 4 MiB chunks",
                     pipeline_calls(pools, direction, tokens, page, 15, 4 * MIB, False,
                                    staging), 15))
        todo.append((tokens, page, "split: 35% SM kernel + pipeline 1 launch",
                     pipeline_calls(pools, direction, tokens, page, 15, 4 * MIB, True, staging,
                                    0.35), 15))
    for tokens in (32768, 65536):
        for quota in (4, 8, 16, 132):
            variant = hicache_calls.Variant("kernel", "kernel", options={"block_quota": quota})
            todo.append((tokens, 1, f"jitk kernel, {quota} blocks",
                         hicache_calls.layer_calls(variant, pools, direction, tokens, 1), 0))
        for streams in (1, 2, 4):
            todo.append((tokens, 16, f"jitk copy_engine on {streams} streams",
                         multi_stream_calls(pools, direction, tokens, 16, streams), 0))
        todo.append((tokens, 1, "copy_ contiguous", hicache_calls.contiguous_calls(pools, direction,
                                                                            tokens), 0))
    return todo


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--in-cache", action="store_true",
                        help="only the pipeline with its staging in the CPU's caches, against "
                        "the 4 MiB non-temporal one (no ceilings, no resident blocks)")
    args = parser.parse_args()
    module()
    if args.build_only:
        return
    print("device:", common.device_name(), "| CPUs:", os.cpu_count(), flush=True)
    result = {"ceilings": [], "resident": [], "overlap": []}
    pools = hicache_calls.pools_for(ROW)
    if not args.in_cache:
        print("host ceilings (pinned memory):", flush=True)
        host_ceilings(result["ceilings"], pools)
    staging = Staging(65536 * ROW, 8 * MIB)
    for direction in ("h2d", "d2h"):
        for page in (1, 16):
            for one_launch, non_temporal, streams in (
                    (False, True, False), (True, True, False), (True, False, False),
                    (False, True, True), (False, False, True)):
                try:
                    check(pools, direction, page, staging, one_launch, non_temporal, streams)
                except AssertionError as error:  # reported; the timings still mean something
                    print("CHECK FAILED:", error, flush=True)
    print("pipelines checked (h2d, d2h; pages 1, 16; per chunk, one launch and per-thread "
          "streams; cached and non-temporal stores)", flush=True)
    streams = [torch.cuda.Stream()]
    with torch.cuda.stream(torch.cuda.Stream()):
        gemm = hicache_timing.make_gemm()
        gemm_ms = hicache_timing.gemm_alone_ms(gemm)
        print(f"GEMM alone {gemm_ms:.2f} ms", flush=True)
        if not args.in_cache:
            resident_slowdown(result["resident"], gemm, gemm_ms)
        rows_of = in_cache_rows if args.in_cache else todo_rows
        for direction in ("h2d", "d2h"):
            for tokens, page, label, calls, threads in rows_of(pools, staging, direction):
                shape = {"direction": direction, "tokens": tokens, "page": page}
                try:
                    row = hicache_timing.overlap_row(label, calls, 2 * tokens * ROW, streams, gemm,
                                            gemm_ms, 3)
                    row["threads"] = threads
                    row["call ms"] = latency_ms(calls)
                except RuntimeError as error:
                    row = {"method": label, "error": str(error)[:200]}
                result["overlap"].append({**shape, **row})
                print("  ", bench._short(result["overlap"][-1]), flush=True)
    if not args.in_cache:
        common.print_table("host ceilings", result["ceilings"], list(result["ceilings"][0]))
        common.print_table("GEMM time with resident blocks", result["resident"],
                           list(result["resident"][0]))
    common.print_table("beside the GEMM (GB/s of K+V data; call ms: one call alone)",
                       result["overlap"], ["direction", "tokens", "page", "method", "threads",
                                           "alone GB/s", "beside GB/s", "GEMM slowdown",
                                           "call ms"])
    common.write_json(args.json, result)


if __name__ == "__main__":
    main()
