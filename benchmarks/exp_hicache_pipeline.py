"""Experiment (issue #17, point 4): pages of 1 and 16 tokens x 1 KiB (K+V, one layer call)
beside a saturating GEMM (12 x bf16 8192^3 on the main stream), through the pipelines of
exp_hicache_pipeline.cuh (CPU threads gather/scatter host pages into pinned chunks, the copy
engines move the chunks, a GPU kernel scatters/gathers device pages):

1. host ceilings: a contiguous copy between pinned 256 MiB buffers by 1..16 threads, alone
   and while a full-speed H2D copy reads the same DRAM;
2. the device half alone (a d2d page gather/scatter kernel), alone and beside the GEMM;
3. the pipelines (threads, chunk size, non-temporal stores), alone and beside the GEMM,
   with jitk's kernel, copy engines and a contiguous copy_ as references;
4. a split: a share of the pages by jitk's SM kernel on a second stream, the rest by the
   pipeline, at once.
Each pipeline is checked exact once against torch (poisoned destination). Per-call latency
is the median time of one call alone; --json writes the rows. --build-only builds and exits.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_hicache as bench  # noqa: E402
import common  # noqa: E402

from jitk import hicache, load_jit  # noqa: E402

ROW = 1024  # bytes per token per layer, K and V each
MIB = 1 << 20
SLOTS = 4  # pinned staging chunks in flight
BLOCKS = 16  # blocks of the device half


@functools.cache
def module():
    names = ("load_back", "write_back", "device_half", "host_copy_gbps")
    return load_jit("exp_hicache_pipeline",
                    cuda_files=[os.path.join(os.path.dirname(__file__),
                                             "exp_hicache_pipeline.cuh")],
                    cuda_wrappers=[(n, f"jitk::exp_pipeline::Pipeline::{n}") for n in names])


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


class Staging:
    """Pinned chunks and a device staging area, sized for the largest call."""

    def __init__(self, max_bytes: int, chunk_bytes: int):
        self.host = torch.empty(SLOTS * 2 * chunk_bytes, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty(2 * max_bytes, dtype=torch.uint8, device="cuda")


def pipeline_calls(pools, direction: str, tokens: int, page: int, threads: int,
                   chunk_bytes: int, non_temporal: bool, staging: Staging, share: float = 0.0):
    """One call per index set: a layer's K+V by the pipeline; with `share` > 0 that share
    of the pages goes by jitk's SM kernel on a second stream at the same time."""
    piece = page * ROW
    entry = module().load_back if direction == "h2d" else module().write_back
    side = torch.cuda.Stream()
    split = int(round(share * tokens / page)) * page  # whole pages
    calls = []
    for _ in range(bench.INDEX_SETS):
        host_tokens = bench.page_indices(tokens, bench.HOST_POOL, page)
        gpu_tokens = bench.page_indices(tokens, bench.GPU_POOL, page)
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
            threads, BLOCKS, non_temporal)
        calls.append(functools.partial(split_call, kernel if split else None,
                                       pipeline if split < tokens else None, side))
    return calls


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


def check(pools, direction: str, page: int, staging: Staging) -> None:
    """One pipeline call on fresh indices against torch, destination poisoned."""
    tokens = 2048
    host_tokens = bench.page_indices(tokens, bench.HOST_POOL, page)
    gpu_tokens = bench.page_indices(tokens, bench.GPU_POOL, page).cuda()
    dst, src = pools.sides(direction)
    i_dst, i_src = (gpu_tokens, host_tokens) if direction == "h2d" else (host_tokens, gpu_tokens)
    for d in dst:
        d.index_fill_(0, i_dst.to(d.device), float("nan"))
    entry = module().load_back if direction == "h2d" else module().write_back
    entry(flat(pools.host[0]), flat(pools.host[1]), host_tokens[::page].contiguous(),
          flat(pools.gpu[0]), flat(pools.gpu[1]), gpu_tokens[::page].contiguous(), staging.host,
          staging.dev, 2, ROW, page, max(1, 256 * 1024 // (page * ROW)), SLOTS, 3, BLOCKS, True)
    torch.cuda.synchronize()
    for d, s in zip(dst, src):
        got, want = d[i_dst.to(d.device)], s[i_src.to(s.device)]
        if not torch.equal(got.cpu(), want.cpu()):
            raise AssertionError(f"pipeline {direction} page {page}: rows differ")


def host_ceilings(rows: list) -> None:
    """Contiguous pinned->pinned copies by 1..16 threads, alone and beside a full H2D copy."""
    size = 256 * MIB
    a, b = (torch.empty(size, dtype=torch.uint8, pin_memory=True).fill_(1) for _ in range(2))
    dma_src = torch.empty(size, dtype=torch.uint8, pin_memory=True).fill_(2)
    dma_dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    copy = module().host_copy_gbps
    for threads in (1, 2, 4, 8, 16):
        for nt in (False, True):
            copy(b, a, threads, 1, nt)
            alone = copy(b, a, threads, 4, nt)
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            for _ in range(16):  # ~75 ms at 55 GB/s
                dma_dst.copy_(dma_src, non_blocking=True)
            end.record()
            beside = []
            while not end.query():
                beside.append(copy(b, a, threads, 1, nt))
            end.synchronize()
            dma = 16 * size / (start.elapsed_time(end) * 1e6)
            rows.append({"threads": threads, "non-temporal": nt, "copy alone GB/s": alone,
                         "copy beside H2D GB/s": statistics.median(beside) if beside else "n/a",
                         "H2D GB/s meanwhile": dma})
            print("  ", bench._short(rows[-1]), flush=True)
    dma_alone = size / common.time_us(lambda: dma_dst.copy_(dma_src, non_blocking=True)) / 1e3
    rows.append({"threads": 0, "H2D GB/s meanwhile": dma_alone})
    print("   H2D alone", round(dma_alone, 1), flush=True)


def device_half_calls(pools, direction: str, tokens: int, page: int, staging: Staging):
    calls = []
    for _ in range(bench.INDEX_SETS):
        idx = bench.page_indices(tokens, bench.GPU_POOL, page)[::page].cuda()

        def call(idx=idx):
            for c in range(2):
                module().device_half(staging.dev[c * tokens * ROW:], flat(pools.gpu[c]), idx,
                                     ROW, page, BLOCKS, direction == "d2h")
        calls.append(call)
    return calls


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


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--build-only", action="store_true")
    args = parser.parse_args()
    module()
    if args.build_only:
        return
    print("device:", common.device_name(), "| CPUs:", os.cpu_count(), flush=True)
    result = {"ceilings": [], "overlap": []}
    print("host ceilings (pinned -> pinned, contiguous):", flush=True)
    host_ceilings(result["ceilings"])
    pools = bench.pools_for(ROW)
    staging = Staging(32768 * ROW, 4 * MIB)
    for direction in ("h2d", "d2h"):
        for page in (1, 16):
            check(pools, direction, page, staging)
    print("pipelines exact (h2d, d2h; pages 1, 16)", flush=True)
    streams = [torch.cuda.Stream()]
    with torch.cuda.stream(torch.cuda.Stream()):
        gemm = bench.make_gemm()
        gemm_ms = bench.gemm_alone_ms(gemm)
        print(f"GEMM alone {gemm_ms:.2f} ms", flush=True)
        configs = [(8, MIB, True), (15, MIB, True), (15, 4 * MIB, True), (15, MIB, False),
                   (4, MIB, True)]
        for direction in ("h2d", "d2h"):
            for tokens in (32768, 4096):
                for page in (1, 16):
                    todo = [(f"device half alone ({BLOCKS} blocks)",
                             device_half_calls(pools, direction, tokens, page, staging), 0)]
                    for threads, chunk, nt in configs if tokens == 32768 else configs[1:2]:
                        label = (f"pipeline {threads} thr, {chunk // MIB} MiB chunks"
                                 f"{'' if nt else ', plain stores'}")
                        todo.append((label, pipeline_calls(pools, direction, tokens, page, threads,
                                                           chunk, nt, staging), threads))
                    for share in (0.2, 0.35):
                        todo.append((f"split: {share:.0%} SM kernel + pipeline 15 thr",
                                     pipeline_calls(pools, direction, tokens, page, 15, MIB,
                                                    True, staging, share), 15))
                    for variant in (bench.Variant("jitk kernel", "kernel"),
                                    bench.Variant("jitk copy_engine", "copy_engine", True)):
                        todo.append((variant.label, bench.layer_calls(
                            variant, pools, direction, tokens, page), 0))
                    if page == 1:
                        todo.append(("copy_ contiguous",
                                     bench.contiguous_calls(pools, direction, tokens), 0))
                    for label, calls, threads in todo:
                        shape = {"direction": direction, "tokens": tokens, "page": page}
                        try:
                            row = bench.overlap_row(label, calls, 2 * tokens * ROW, streams, gemm,
                                                    gemm_ms, 3)
                            row["threads"] = threads
                            row["call ms"] = latency_ms(calls)
                        except RuntimeError as error:
                            row = {"method": label, "error": str(error)[:200]}
                        result["overlap"].append({**shape, **row})
                        print("  ", bench._short(result["overlap"][-1]), flush=True)
    common.print_table("host ceilings", result["ceilings"], list(result["ceilings"][0]))
    common.print_table("beside the GEMM (GB/s of K+V data; call ms: one call alone)",
                       result["overlap"], ["direction", "tokens", "page", "method", "threads",
                                           "alone GB/s", "beside GB/s", "GEMM slowdown",
                                           "call ms"])
    common.write_json(args.json, result)


if __name__ == "__main__":
    main()
