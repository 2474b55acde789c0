"""Sweep of the HiCache kernel's knobs (unroll, block quota) per direction and shape, to
choose the defaults. Prints GB/s per setting and the best per shape.
    python benchmarks/tune_hicache.py [--json PATH]"""

import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
from bench_hicache import PLACES, index_sets, random_rows, rotating  # noqa: E402

from jitk import hicache  # noqa: E402

SHAPES = [("d2d", 4096, 1024), ("d2d", 4096, 2048), ("d2d", 32768, 1024),
          ("h2d", 32768, 1024), ("h2d", 32768, 4096), ("d2h", 32768, 1024)]
UNROLLS = (2, 4, 8)
SETTINGS = [(unroll, quota) for unroll in UNROLLS for quota in (None, 2, 4)]


def build(config):
    hicache._kernels(*config)


def prebuild(unrolls):
    """Every (row bytes, unroll) module, in parallel processes: serially they take minutes."""
    configs = {(row_bytes, unroll) for _, _, row_bytes in SHAPES for unroll in unrolls}
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=len(configs), mp_context=context) as pool:
        list(pool.map(build, sorted(configs)))


def main():
    args = common.parse_args(__doc__)
    prebuild((4,) if args.quick else UNROLLS)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("device:", common.device_name())
    rows = []
    for direction, tokens, row_bytes in SHAPES:
        src_where, dst_where = PLACES[direction]
        pool = max(2 * tokens, (64 << 20) // row_bytes)
        dst = [random_rows(pool, row_bytes, dst_where) for _ in range(2)]
        src = [random_rows(pool, row_bytes, src_where) for _ in range(2)]
        sets = index_sets(tokens, pool, row_bytes)
        moved = 2 * tokens * row_bytes * (2 if direction == "d2d" else 1)
        for unroll, quota_per_sm in [(4, None)] if args.quick else SETTINGS:
            quota = None if quota_per_sm is None else quota_per_sm * sms
            call = rotating([lambda i=i, j=j: hicache.transfer_hicache_one_layer(
                dst[0], dst[1], i, src[0], src[1], j, unroll=unroll, block_quota=quota)
                for i, j in zip(sets, reversed(sets))])
            us = common.time_us(call)
            rows.append({"direction": direction, "tokens": tokens, "bytes": row_bytes,
                         "unroll": unroll, "blocks/SM": quota_per_sm or "default",
                         "us": us, "GB/s": moved / us / 1e3})
        del dst, src
        torch.cuda.empty_cache()
    common.print_table("hicache sweep", rows,
                       ["direction", "tokens", "bytes", "unroll", "blocks/SM", "us", "GB/s"])
    best = {}
    for row in rows:
        key = (row["direction"], row["tokens"], row["bytes"])
        if key not in best or row["GB/s"] > best[key]["GB/s"]:
            best[key] = row
    common.print_table("best per shape", list(best.values()),
                       ["direction", "tokens", "bytes", "unroll", "blocks/SM", "GB/s"])
    common.write_json(args.json, {"device": common.device_name(), "rows": rows})


if __name__ == "__main__":
    main()
