"""Experiment (issue #11): can SM-driven host->GPU reads of random 1 KiB rows reach the pinned
copy_'s bandwidth? Times the product kernel (several block quotas and unrolls) and the
variants of exp_hicache_h2d.cuh (an L2 prefetch-size hint, an L2 bulk prefetch, the SM's bulk
copy engine) against a pinned copy_ of the same bytes, taken alternately in the same run.

K+V, page size 1, indices random over a 256K-token pinned host pool (GPU pool 64K tokens),
4096 and 32768 tokens x 1 KiB rows. Every variant is checked exact once (poisoned
destination). `--build-only` builds the modules and exits (to overlap the build with other
work). Prints one table; --json writes the rows."""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics

import torch

import common  # noqa: E402

from jitk import load_jit
from jitk.kernels import hicache  # noqa: E402

ROW = 1024
HOST_POOL = 256 * 1024
GPU_POOL = 64 * 1024
SETS = 8
POISON = 0x7B
TIMING = {"warmup_ms": 10, "rep_ms": 40}

# label -> (C++ entry, blocks)
EXP = {
    "reg L2::256B": ("Reg<1024, 4, 1>", (6, 16, 132)),
    "reg nc L2::256B": ("Reg<1024, 4, 2>", (6,)),
    "reg + bulk L2 prefetch": ("Reg<1024, 4, 3>", (16,)),
    "bulk d2 l0 w1": ("Bulk<1024, 2, 0, 1>", (6, 16, 132)),
    "bulk d4 l1 w1": ("Bulk<1024, 4, 1, 1>", (16,)),
    "bulk d2 l0 w2": ("Bulk<1024, 2, 0, 2>", (16,)),
}
PRODUCT = [  # (label, unroll, block quota)
    ("product u4", 4, 6), ("product u4", 4, 16), ("product u4", 4, 132), ("product u8", 8, 16),
]


@functools.cache
def module():
    names = {label: f"jitk::exp_h2d::{entry}::run" for label, (entry, _) in EXP.items()}
    exports = [(f"v{i}", target) for i, target in enumerate(names.values())]
    built = load_jit("exp_hicache_h2d", cuda_files=[os.path.join(os.path.dirname(__file__),
                                                                 "exp_hicache_h2d.cuh")],
                     cuda_wrappers=exports)
    return {label: getattr(built, name) for label, (name, _) in zip(names, exports)}


def build() -> None:
    module()
    # The product modules the experiment uses (element size 1 KiB, unrolls 4 and 8).
    for unroll in (4, 8):
        hicache._kernel_module(ROW, unroll)


def random_rows(rows: int, where: str) -> torch.Tensor:
    shape = (rows, ROW // 2)
    out = (torch.empty(shape, dtype=torch.float16, device="cuda") if where == "cuda" else
           torch.empty(shape, dtype=torch.float16, pin_memory=True))
    step = 65536
    for first in range(0, rows, step):
        out[first:first + step].copy_(torch.randn(min(step, rows - first), ROW // 2,
                                                  device="cuda").half())
    torch.cuda.synchronize()
    return out


def index_sets(tokens: int, contiguous: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    sets = []
    for _ in range(SETS):
        if contiguous:
            s0 = int(torch.randint(0, HOST_POOL - tokens, ()))
            d0 = int(torch.randint(0, GPU_POOL - tokens + 1, ()))
            src, dst = torch.arange(s0, s0 + tokens), torch.arange(d0, d0 + tokens)
        else:
            src, dst = torch.randperm(HOST_POOL)[:tokens], torch.randperm(GPU_POOL)[:tokens]
        sets.append((dst.cuda(), src.cuda()))
    return sets


def check_exact(call, dst, src, idx) -> None:
    for d in dst:
        d.view(torch.uint8).fill_(POISON)
    call(*idx)
    torch.cuda.synchronize()
    for d, s in zip(dst, src):
        got, want = d[idx[0].to(d.device)].cpu(), s[idx[1].to(s.device)].cpu()
        if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            raise AssertionError("rows differ")


def rotating(call, sets):
    cycle = itertools.cycle(sets)
    return lambda: call(*next(cycle))


def measure(call, copy, rounds: int) -> tuple[float, float]:
    ours, ref = [], []
    for _ in range(rounds):
        ref.append(common.time_us(copy, **TIMING))
        ours.append(common.time_us(call, **TIMING))
    return statistics.median(ours), statistics.median(ref)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    build()
    if args.build_only:
        return
    entries = module()
    host = [random_rows(HOST_POOL, "cpu") for _ in range(2)]
    gpu = [random_rows(GPU_POOL, "cuda") for _ in range(2)]
    rows = []
    torch.cuda.set_stream(torch.cuda.Stream())
    h2d, d2h = common.pinned_copy_gbps()
    print(f"pinned copy_ 256 MiB: h2d {h2d:.1f} GB/s, d2h {d2h:.1f} GB/s", flush=True)
    for tokens in (4096, 32768):
        moved = 2 * tokens * ROW
        copy_src = torch.empty(moved, dtype=torch.uint8, pin_memory=True).random_()
        copy_dst = torch.empty(moved, dtype=torch.uint8, device="cuda")
        h2d_copy = functools.partial(copy_dst.copy_, copy_src, non_blocking=True)
        d2h_copy = functools.partial(copy_src.copy_, copy_dst, non_blocking=True)
        random_sets, contiguous_sets = index_sets(tokens, False), index_sets(tokens, True)
        todo = []  # (label, blocks, indices, direction, call(idx_dst, idx_src))
        for label, unroll, quota in PRODUCT:
            todo.append((label, quota, "random", "h2d", functools.partial(
                product_call, gpu, host, unroll, quota)))
        todo.append(("product u4", 6, "contiguous", "h2d",
                     functools.partial(product_call, gpu, host, 4, 6)))
        for label, (_, block_counts) in EXP.items():
            for blocks in block_counts:
                todo.append((label, blocks, "random", "h2d",
                             functools.partial(exp_call, entries[label], gpu, host, blocks)))
        todo.append(("bulk d2 l0 w1", 132, "contiguous", "h2d",
                     functools.partial(exp_call, entries["bulk d2 l0 w1"], gpu, host, 132)))
        todo.append(("product u4 (write-back)", 6, "random", "d2h",
                     functools.partial(product_call, host, gpu, 4, 6)))
        for label, blocks, kind, direction, call in todo:
            sets = random_sets if kind == "random" else contiguous_sets
            if direction == "d2h":
                sets = [(s, d) for d, s in sets]
            try:
                check_exact(call, *((host, gpu) if direction == "d2h" else (gpu, host)),
                            sets[0])
                us, copy_us = measure(rotating(call, sets),
                                      h2d_copy if direction == "h2d" else d2h_copy, args.rounds)
            except (AssertionError, RuntimeError) as error:  # one failure must not end the run
                print(f"   {label} ({blocks} blocks): {error}", flush=True)
                continue
            rows.append({"tokens": tokens, "dir": direction, "variant": label,
                         "blocks": blocks, "indices": kind, "us": us,
                         "GB/s": moved / us / 1e3, "copy_ GB/s": moved / copy_us / 1e3,
                         "ratio": copy_us / us})
            print("  ", rows[-1], flush=True)
    common.write_json(args.json, {"device": common.device_name(), "rows": rows})
    common.print_table(f"h2d variants, K+V x 1 KiB rows, page 1 ({common.device_name()})", rows,
                       ["tokens", "dir", "variant", "blocks", "indices", "us", "GB/s",
                        "copy_ GB/s", "ratio"])


def product_call(dst, src, unroll, quota, idx_dst, idx_src):
    hicache.transfer_hicache_one_layer(dst[0], dst[1], idx_dst, src[0], src[1], idx_src,
                                       element_dim=ROW // 2, method="kernel", unroll=unroll,
                                       block_quota=quota)


def exp_call(entry, dst, src, blocks, idx_dst, idx_src):
    entry(dst[0], dst[1], idx_dst, src[0], src[1], idx_src, blocks)


if __name__ == "__main__":
    main()
