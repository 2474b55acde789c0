"""HiCache KV transfers: jitk's index-list kernels against the ceilings measured in this run
(a pinned contiguous copy_ of the same bytes for d2h/h2d, a 1 GiB device copy_ for d2d) and
against naive torch indexing (`k_dst[idx_dst] = k_src[idx_src]`, with the host side's
indices on the host).

Bytes per token are K's (V the same); GB/s count K+V data moved, and for d2d bytes read plus
bytes written, as the device-copy ceiling does. Caches are fp16 pools of at least 64 MiB (or
twice the tokens), indices random subsets of the pool, and calls rotate over index sets that
together touch more than the 50 MB L2. The first run builds one module per row size (about
10-20 s each); `python -m jitk precompile` fills the cache ahead of time.
"""

import itertools
import statistics
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

from jitk import hicache  # noqa: E402

MIB = 1 << 20
POOL_BYTES = 64 * MIB  # per cache, at least
ROTATION_BYTES = 128 * MIB  # moved by one pass over the index sets, at least
MAX_INDEX_SETS = 64
PLACES = {"d2h": ("cuda", "cpu"), "h2d": ("cpu", "cuda"), "d2d": ("cuda", "cuda")}

FULL_SHAPES = [(direction, tokens, row_bytes) for direction in PLACES
               for tokens in (64, 4096, 32768) for row_bytes in (256, 1024, 2048, 4096)]
QUICK_SHAPES = [(d, 4096, b) for d in ("d2h", "h2d") for b in (256, 1024, 2048)] + [
    ("d2d", 4096, 1024), ("d2h", 64, 1024)]
ALL_LAYER = (32, 4096, 1024)  # layers, tokens, bytes per token and layer
COLUMNS = ["direction", "tokens", "bytes/token", "jitk us", "jitk GB/s", "ceiling GB/s",
           "ratio", "same-size copy GB/s", "vs same-size copy", "torch-index us", "graph us"]


def random_rows(rows: int, row_bytes: int, where: str) -> torch.Tensor:
    """fp16 rows of random data (never zeros), on the GPU or pinned on the host."""
    data = torch.randn(rows, row_bytes // 2, dtype=torch.float16, device="cuda")
    if where == "cuda":
        return data
    host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
    host.copy_(data)
    return host


def index_sets(tokens: int, pool_rows: int, row_bytes: int) -> list[torch.Tensor]:
    """Random distinct row numbers, one set per call in the rotation, on the GPU."""
    count = min(MAX_INDEX_SETS, max(1, -(-ROTATION_BYTES // (2 * tokens * row_bytes))))
    return [torch.randperm(pool_rows, device="cuda")[:tokens] for _ in range(count)]


def rotating(calls):
    """One zero-argument function that runs the next of `calls` each time."""
    cycle = itertools.cycle(calls)
    return lambda: next(cycle)()


def same_size_copy(direction: str, nbytes: int):
    """A contiguous copy_ of the same bytes between the same kinds of memory."""
    src_at, dst_at = PLACES[direction]
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    src = src if src_at == "cuda" else src.cpu().pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_at, pin_memory=dst_at == "cpu")
    return lambda: dst.copy_(src, non_blocking=True)


def timed_against_copy(direction, moved, jitk_call, timing, rounds=3):
    """(jitk us, same-size copy us), each the median of rounds taken alternately: PCIe
    bandwidth drifts by a few percent between measurements, and a ratio of two numbers
    taken minutes apart would carry that drift."""
    copy_call = same_size_copy(direction, moved)
    jitk, copy = [], []
    for _ in range(rounds):
        copy.append(common.time_us(copy_call, **timing))
        jitk.append(common.time_us(jitk_call, **timing))
    return statistics.median(jitk), statistics.median(copy)


def torch_index_call(direction, dst, src, idx_dst, idx_src):
    """Naive torch: the gather runs where the source is, the scatter where the destination
    is, with a copy between them."""
    if direction == "d2d":
        def call():
            for d, s in zip(dst, src):
                d[idx_dst] = s[idx_src]
    elif direction == "d2h":
        idx_dst = idx_dst.cpu()

        def call():
            for d, s in zip(dst, src):
                d[idx_dst] = s[idx_src].cpu()
    else:
        idx_src = idx_src.cpu()

        def call():
            for d, s in zip(dst, src):
                d[idx_dst] = s[idx_src].to("cuda", non_blocking=True)
    return call


def measure_one_layer(direction, tokens, row_bytes, device_copy, timing):
    src_at, dst_at = PLACES[direction]
    pool_rows = max(2 * tokens, POOL_BYTES // row_bytes)
    src = [random_rows(pool_rows, row_bytes, src_at) for _ in range(2)]
    dst = [random_rows(pool_rows, row_bytes, dst_at) for _ in range(2)]
    sets = list(zip(index_sets(tokens, pool_rows, row_bytes),
                    index_sets(tokens, pool_rows, row_bytes)))
    jitk_calls = [lambda d=d, s=s: hicache.transfer_hicache_one_layer(dst[0], dst[1], d, src[0],
                                                                      src[1], s)
                  for d, s in sets]
    moved = 2 * tokens * row_bytes
    jitk_us, copy_us = timed_against_copy(direction, moved, rotating(jitk_calls), timing)
    torch_us = common.time_us(rotating([torch_index_call(direction, dst, src, d, s)
                                        for d, s in sets[:4]]), **timing)
    # Latency rows: the kernel's own time, launch gaps removed by graph replay.
    graph_us = common.time_graph_us(jitk_calls[0]) if tokens <= 64 else ""
    return row(direction, tokens, row_bytes, moved, jitk_us, copy_us, device_copy, torch_us,
               graph_us)


def row(direction, tokens, row_bytes, moved, jitk_us, copy_us, device_copy, torch_us, graph_us):
    """The ceiling is the same-size pinned copy for PCIe, the 1 GiB device copy for d2d
    (counting bytes read and written); the same-size copy is shown for d2d too."""
    counted = 2 * moved if direction.startswith("d2d") else moved
    gbps = counted / jitk_us / 1e3
    copy_gbps = counted / copy_us / 1e3
    ceiling = device_copy if direction.startswith("d2d") else copy_gbps
    return {"direction": direction, "tokens": tokens, "bytes/token": row_bytes,
            "jitk us": jitk_us, "jitk GB/s": gbps, "ceiling GB/s": ceiling,
            "ratio": gbps / ceiling, "same-size copy GB/s": copy_gbps,
            "vs same-size copy": gbps / copy_gbps, "torch-index us": torch_us,
            "graph us": graph_us}


def measure_all_layer(direction, device_copy, timing):
    layers, tokens, row_bytes = ALL_LAYER
    src_at, dst_at = PLACES[direction]
    pool_rows = 2 * tokens
    # K and V of every layer, each its own pool; the pointer tables list their bases.
    src = [[random_rows(pool_rows, row_bytes, src_at) for _ in range(layers)] for _ in range(2)]
    dst = [[random_rows(pool_rows, row_bytes, dst_at) for _ in range(layers)] for _ in range(2)]
    tables = [torch.tensor([t.data_ptr() for t in side], dtype=torch.int64, device="cuda")
              for side in (*dst, *src)]
    idx_dst = torch.randperm(pool_rows, device="cuda")[:tokens]
    idx_src = torch.randperm(pool_rows, device="cuda")[:tokens]

    def jitk_call():
        hicache.transfer_hicache_all_layer(
            tables[0], tables[1], idx_dst, tables[2], tables[3], idx_src,
            kv_cache_src_stride_bytes=row_bytes, kv_cache_dst_stride_bytes=row_bytes)

    per_layer = [torch_index_call(direction, [dst[0][i], dst[1][i]], [src[0][i], src[1][i]],
                                  idx_dst, idx_src) for i in range(layers)]
    moved = 2 * layers * tokens * row_bytes
    jitk_us, copy_us = timed_against_copy(direction, moved, jitk_call, timing)
    torch_us = common.time_us(lambda: [call() for call in per_layer], **timing)
    return row(f"{direction} all-layer x{layers}", tokens, row_bytes, moved, jitk_us, copy_us,
               device_copy, torch_us, "")


def main():
    args = common.parse_args(__doc__)
    timing = {"warmup_ms": 10, "rep_ms": 40} if args.quick else {}
    print("device:", common.device_name())
    device_copy = common.device_copy_gbps()
    h2d, d2h = common.pinned_copy_gbps()
    print(f"device copy {device_copy:.0f} GB/s (read+write); pinned copy 256 MiB: "
          f"h2d {h2d:.1f} GB/s, d2h {d2h:.1f} GB/s")
    rows = []
    for shape in QUICK_SHAPES if args.quick else FULL_SHAPES:
        rows.append(measure_one_layer(*shape, device_copy, timing))
        print("  ", {k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()},
              flush=True)
        torch.cuda.empty_cache()
    for direction in ("d2h",) if args.quick else ("d2h", "h2d"):
        rows.append(measure_all_layer(direction, device_copy, timing))
        torch.cuda.empty_cache()
    common.print_table("hicache transfers (ratio = jitk GB/s / ceiling GB/s)", rows, COLUMNS)
    common.write_json(args.json, {"device": common.device_name(), "device_copy_gbps": device_copy,
                                  "pinned_h2d_gbps": h2d, "pinned_d2h_gbps": d2h, "rows": rows})


if __name__ == "__main__":
    main()
