"""HiCache KV transfers: every method against the ceilings measured in this run (a pinned
contiguous copy_ of the same bytes for d2h/h2d, a 1 GiB device copy_ for d2d), alone and
beside a compute-saturating GEMM on another stream.

Tables:
- solo: today's shapes (pools of 64 MiB or twice the tokens, page size 1, GPU indices, the
  default method: the kernel), then indices over a 256K-token host pool with pages of 1 and
  64 tokens for the kernel and the copy engines (host indices). Bytes per token are K's (V
  the same); GB/s count K+V data moved, and for d2d bytes read plus bytes written.
- overlap: GEMM alone (12 x bf16 8192^3, ms), a load-back / write-back of one layer call after
  another on a side stream alone (GB/s), the same beside the GEMMs (GB/s, counting only the
  layers done before the GEMMs end) and the GEMMs' slowdown, per method, at 4096 and 32768
  tokens x 256 B / 1 KiB / 4 KiB, pages of 1 / 16 / 64 tokens.
  Besides jitk's methods ("auto" with host indices included): a gathered write-back (GPU
  gather, one copy-engine block into consecutive host slots), a CPU-gathered load-back
  (torch's threads, one copy into consecutive GPU slots), and with --peers SGLang 0.5.23's
  register and TMA kernels from .peers/sgl523 (PYTHONPATH); --pages picks the page sizes.
  With --split SMS, the SM methods again on SMS SMs of their own (jitk.split_sms: jitk's
  kernel on one block an SM to load, 4 to write back, SGLang's with their own launch) beside
  the GEMMs on the other SMs: slowdown against the GEMMs alone there, and against all SMs.
- staged (--staged): the staged write-back (layer_first GPU -> page_first host), alone and
  beside the GEMMs, pages of 1 / 16 / 64; with --peers first jitk against SGLang 0.5.23's
  own staged write-back (K/V and MLA, pages of 1 / 16 / 64 / 128, interleaved rounds, both
  checked exact, ratios to a pinned d2h copy_ of the same bytes).
- sweep (--sweep): the kernel's bandwidth per block quota, which picks its default.
Transfers run on side streams (the copy engines' batch submission refuses the legacy default
stream). --quick measures a subset.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import common
import torch
from hicache_calls import (
    GPU_POOL,
    HOST_POOL,
    INDEX_SETS,
    MIB,
    PLACES,
    Variant,
    caches_calls,
    check_staged,
    contiguous_calls,
    cpu_gathered_load_calls,
    gathered_write_back_calls,
    layer_calls,
    page_indices,
    pools_for,
    random_rows,
    rotating,
    same_size_copy,
    solo_variants,
    staged_call,
    torch_index_call,
    variants,
)
from hicache_timing import (
    GEMM,
    gemm_alone_ms,
    guarded_row,
    make_gemm,
    overlap_row,
    run_layers,
    solo_row,
)

import jitk
from jitk.kernels import hicache


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--quick", action="store_true", help="fewer shapes, shorter runs")
    parser.add_argument("--sweep", action="store_true", help="block quota sweep")
    parser.add_argument("--skip-solo", action="store_true", help="no solo table")
    parser.add_argument("--skip-overlap", action="store_true", help="no overlap table")
    parser.add_argument("--pages", default=None,
                        help="overlap table: page sizes, e.g. 1,16 (default 64,16,1)")
    parser.add_argument("--staged", action="store_true",
                        help="the staged write-back (layer_first GPU -> page_first host), alone "
                             "and beside the GEMMs, pages of 1 / 16 / 64; with --peers first "
                             "jitk vs SGLang 0.5.23's, pages of 1 / 16 / 64 / 128")
    parser.add_argument("--split", type=int, default=0, metavar="SMS",
                        help="overlap table: also each SM method on SMS SMs of its own "
                             "(jitk.split_sms), the GEMMs on the rest")
    parser.add_argument("--peers", action="store_true",
                        help="overlap table: SGLang 0.5.23's kernels too (PYTHONPATH with "
                             ".peers/sgl523, see ../shared/peers/README.md)")
    return parser.parse_args()


def overlap_table(args, sms) -> list[dict]:
    gemm = make_gemm()
    gemm_ms = gemm_alone_ms(gemm)
    print(f"GEMM alone: {GEMM[0]} x bf16 {GEMM[1]}^3 = {gemm_ms:.2f} ms", flush=True)
    streams = [torch.cuda.Stream()]
    split = jitk.split_sms(args.split) if args.split else None
    pages = [int(p) for p in args.pages.split(",")] if args.pages else None
    shapes = ([(4096, 1024, p) for p in pages or (64, 1)] if args.quick else
              list(itertools.product((4096, 32768), (1024, 4096, 256), pages or (64, 16, 1))))
    rows = []
    for row_bytes in dict.fromkeys(b for _, b, _ in shapes):  # the headline sizes first
        pools = pools_for(row_bytes)
        for direction in ("h2d", "d2h"):
            for tokens, _, page in [s for s in shapes if s[1] == row_bytes]:
                layer_bytes = 2 * tokens * row_bytes
                todo = [(v.label, layer_calls(v, pools, direction, tokens, page))
                        for v in variants(sms, args.peers)]
                if direction == "d2h":
                    todo.append(("gather + copy_engine (host slots in one run)",
                                 gathered_write_back_calls(pools, tokens, page)))
                else:
                    todo.append((f"CPU gather ({torch.get_num_threads()} threads) + copy_ "
                                 "(GPU slots in one run)",
                                 cpu_gathered_load_calls(pools, tokens, page)))
                if page == min(s[2] for s in shapes):  # once per shape: the copy_ reference
                    todo.append(("copy_ contiguous", contiguous_calls(pools, direction, tokens)))
                shape = {"direction": direction, "tokens": tokens, "bytes/token": row_bytes,
                         "page": page}
                for label, calls in todo:
                    rows.append({**shape, **guarded_row(label, calls, layer_bytes, streams, gemm,
                                                        gemm_ms, 2 if args.quick else 3)})
                    print("  ", _short(rows[-1]), flush=True)
                if split is not None:
                    rows += split_rows(args, split, pools, direction, tokens, page, shape,
                                       layer_bytes, gemm)
    if split is not None:
        split.close()
    return rows


def split_rows(args, split, pools, direction, tokens, page, shape, layer_bytes,
               gemm) -> list[dict]:
    """The SM methods on split.own beside the GEMMs on split.rest: jitk's kernel on one block
    an SM to load, 4 blocks to write back (more writers slow the GEMMs:
    experiments/exp_hicache_split.py), and SGLang 0.5.23's kernels with their own launch. The
    GEMM slowdown is against the GEMMs alone on the rest in the same rounds; "vs whole GPU"
    against them on all SMs."""
    with torch.cuda.stream(split.rest):
        rest_ms = gemm_alone_ms(gemm)
    quota = split.own_sms if direction == "h2d" else 4
    found = [Variant("kernel (a block an SM to load, 4 blocks to write back)", "kernel",
                     options={"block_quota": quota})]
    found += [v for v in variants(split.own_sms, args.peers) if v.method == "sglang"]
    rows = []
    for variant in found:
        calls = layer_calls(variant, pools, direction, tokens, page)
        label = f"split {split.own_sms}/{split.rest_sms} SMs: {variant.label}"
        with torch.cuda.stream(split.rest):
            row = guarded_row(label, calls, layer_bytes, [split.own], gemm, rest_ms,
                              2 if args.quick else 3)
        if "GEMM slowdown" in row:  # the GEMMs on all SMs, timed as overlap_row times them
            whole = statistics.median(run_layers([], 0, [], gemm)[1] for _ in range(3))
            row["vs whole GPU"] = row["gemm ms"] * (1 + row["GEMM slowdown"]) / whole - 1
        rows.append({**shape, **row})
        print("  ", _short(rows[-1]), flush=True)
    return rows


STAGED_LAYERS, STAGED_TOKENS, STAGED_HOST, STAGED_CAPACITY = 8, 4096, 32768, 1024


def staged_table(args) -> list[dict]:
    """SGLang's default backup for page_first hosts: K+V rows of 1 KiB, 8 layers, 4096
    tokens a call (64 MiB), random whole pages on both sides, staging of 1024 tokens."""
    gemm = make_gemm()
    gemm_ms = gemm_alone_ms(gemm)
    row = 512  # fp16
    device = [[random_rows(GPU_POOL // 4, 2 * row, "cuda") for _ in range(STAGED_LAYERS)]
              for _ in range(2)]
    host = [torch.empty(STAGED_HOST, STAGED_LAYERS, row, dtype=torch.float16, pin_memory=True)
            for _ in range(2)]
    staging = [torch.empty(STAGED_CAPACITY, STAGED_LAYERS, row, dtype=torch.float16,
                           device="cuda") for _ in range(2)]
    tables = [torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64).cuda()
              for layers in device]
    rows = []
    for page in (1, 16, 64):
        calls = []
        for _ in range(INDEX_SETS):
            src = page_indices(STAGED_TOKENS, GPU_POOL // 4, page).cuda()
            dst = page_indices(STAGED_TOKENS, STAGED_HOST, page)
            calls.append(lambda src=src, dst=dst, page=page:
                         hicache.transfer_hicache_all_layer_staged_lf_pf(
                             tables[0], tables[1], src, dst, staging[0], staging[1], host[0],
                             host[1], page_size=page))
        layer_bytes = 2 * STAGED_TOKENS * STAGED_LAYERS * 2 * row
        row_ = overlap_row("staged write-back", calls, layer_bytes, [torch.cuda.Stream()],
                           gemm, gemm_ms, 2 if args.quick else 3)
        rows.append({"page": page, **row_})
        print("  ", _short(rows[-1]), flush=True)
    return rows


STAGED_PAGES = (1, 16, 64, 128)
STAGED_MLA_ROW = 576  # bf16: DeepSeek's 512 + 64 latent row, 1152 bytes


def staged_peers_table(args) -> list[dict]:
    """The staged write-back, jitk vs SGLang 0.5.23's (staged_write_back.cuh), alone: K/V
    (8 layers x 1 KiB rows) and MLA (8 layers x 1152 B), 4096 tokens a call in random whole
    pages on both sides, staging of 1024 tokens. Same tensors, same process; rounds
    interleave a pinned d2h copy_ of the same bytes (the ceiling), jitk and SGLang; medians.
    Both results are checked exact against torch first (host pool poisoned)."""
    try:
        import sgl523  # noqa: F401  (SGLang's build set-up)
        from sglang.kernels.ops.kvcache import hicache as sglang_hicache
    except ImportError as error:
        print(f"SGLang 0.5.23's staged write-back did not load: {error}", flush=True)
        return []
    rows = []
    for cache in ("K/V", "MLA"):
        caches, row = (2, 512) if cache == "K/V" else (1, STAGED_MLA_ROW)
        dtype = torch.float16 if cache == "K/V" else torch.bfloat16
        device = [[random_rows(GPU_POOL // 4, 2 * row, "cuda").view(dtype)
                   for _ in range(STAGED_LAYERS)] for _ in range(caches)]
        host = [torch.empty(STAGED_HOST, STAGED_LAYERS, row, dtype=dtype, pin_memory=True)
                for _ in range(caches)]
        staging = [torch.empty(STAGED_CAPACITY, STAGED_LAYERS, row, dtype=dtype, device="cuda")
                   for _ in range(caches)]
        tables = [torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64).cuda()
                  for layers in device]
        moved = caches * STAGED_TOKENS * STAGED_LAYERS * 2 * row
        for page in STAGED_PAGES:
            sets = [(page_indices(STAGED_TOKENS, GPU_POOL // 4, page).cuda(),
                     page_indices(STAGED_TOKENS, STAGED_HOST, page)) for _ in range(INDEX_SETS)]

            buffers = (tables, staging, host, page)
            jitk_calls = [staged_call(hicache, buffers, *i) for i in sets]
            sglang_calls = [staged_call(sglang_hicache, buffers, *i) for i in sets]
            for name, calls in (("jitk", jitk_calls), ("sglang", sglang_calls)):
                check_staged(name, calls[0], sets[0], device, host)
            copy_call = same_size_copy("d2h", moved)
            timing = {"warmup_ms": 10, "rep_ms": 60}
            found = {"copy": [], "jitk": [], "sglang": []}
            for _ in range(2 if args.quick else 5):
                found["copy"].append(common.time_us(copy_call, **timing))
                found["jitk"].append(common.time_us(rotating(jitk_calls), **timing))
                found["sglang"].append(common.time_us(rotating(sglang_calls), **timing))
            gbps = {k: moved / statistics.median(v) / 1e3 for k, v in found.items()}
            rows.append({"cache": cache, "page": page,
                         "page bytes": page * STAGED_LAYERS * 2 * row,
                         "jitk GB/s": gbps["jitk"], "sglang GB/s": gbps["sglang"],
                         "jitk / sglang": gbps["jitk"] / gbps["sglang"],
                         "d2h copy_ GB/s": gbps["copy"], "jitk ratio": gbps["jitk"] / gbps["copy"],
                         "sglang ratio": gbps["sglang"] / gbps["copy"]})
            print("  ", _short(rows[-1]), flush=True)
    return rows


def _short(row: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


# ------------------------------------------------------------------------------- solo
def todays_shapes(args, device_copy, timing) -> list[dict]:
    """Pools of 64 MiB or twice the tokens on both sides, page 1, GPU indices, defaults."""
    shapes = ([(d, 4096, b) for d in ("d2h", "h2d") for b in (256, 1024, 2048)] +
              [("d2d", 4096, 1024), ("d2h", 64, 1024)] if args.quick else
              [(d, t, b) for d in PLACES for t in (64, 4096, 32768)
               for b in (256, 1024, 2048, 4096)])
    rows = []
    for shape in shapes:
        rows.append(todays_row(*shape, device_copy, timing))
        print("  ", _short(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    return rows


def todays_row(direction, tokens, row_bytes, device_copy, timing) -> dict:
    src_at, dst_at = PLACES[direction]
    pool = max(2 * tokens, 64 * MIB // row_bytes)
    src = [random_rows(pool, row_bytes, src_at) for _ in range(2)]
    dst = [random_rows(pool, row_bytes, dst_at) for _ in range(2)]
    sets = [[torch.randperm(pool, device="cuda")[:tokens] for _ in range(2)]
            for _ in range(INDEX_SETS)]
    calls = [lambda i=i: hicache.transfer_hicache_one_layer(dst[0], dst[1], i[0], src[0],
                                                            src[1], i[1]) for i in sets]
    row = solo_row(direction, tokens, row_bytes, 1, pool, "default (kernel)",
                   rotating(calls), device_copy, timing)
    row["torch-index us"] = common.time_us(
        rotating([torch_index_call(direction, dst, src, *i) for i in sets[:4]]), **timing)
    if tokens <= 64:  # latency: the kernel's own time, launch gaps removed
        row["graph us"] = common.time_graph_us(calls[0])
    return row


def layout_shapes(args, device_copy, timing) -> list[dict]:
    """SGLang's interleaved host layouts, 8 layers of 32K tokens x 1 KiB: page_first (a
    layer's rows are 8 KiB apart: 2-d copies for the engines) and page_first_direct (pages
    of 64 rows per layer), at 4096 tokens in pages of 64."""
    tokens, row_bytes, page, layers, slots = 4096, 1024, 64, 8, 32768
    gpu = pools_for(row_bytes).gpu
    shapes = {"page_first": (slots, layers, row_bytes // 2),
              "page_first_direct": (slots // page, layers, page, row_bytes // 2)}
    rows = []
    for layout, shape in shapes.items():
        host = [random_rows(slots * layers, row_bytes, "cpu").view(shape)[:, 3]
                for _ in range(2)]
        for direction in ("h2d", "d2h"):
            dst, src = (gpu, host) if direction == "h2d" else (host, gpu)
            for variant in solo_variants():
                call = rotating(caches_calls(variant, dst, src, tokens, page))
                rows.append(solo_row(direction, tokens, row_bytes, page, layout,
                                     variant.label, call, device_copy, timing))
                print("  ", _short(rows[-1]), flush=True)
    return rows


def host_pool_shapes(args, device_copy, timing) -> list[dict]:
    """Indices over a 256K-token host pool, pages of 1 and 64, kernel and copy engines."""
    shapes = ([(4096, 1024)] if args.quick else
              list(itertools.product((4096, 32768), (256, 1024, 4096))))
    rows = []
    for row_bytes in sorted({b for _, b in shapes}):
        pools = pools_for(row_bytes)
        for direction, (tokens, _), page in itertools.product(
                ("h2d", "d2h"), [s for s in shapes if s[1] == row_bytes], (1, 64)):
            for variant in solo_variants():
                calls = layer_calls(variant, pools, direction, tokens, page)
                rows.append(solo_row(direction, tokens, row_bytes, page, HOST_POOL,
                                     variant.label, rotating(calls), device_copy, timing))
                if page > 1 and tokens == 4096:  # graph replay: copies are nodes one by one
                    rows[-1]["graph us"] = common.time_graph_us(calls[0], 10, 10)
                print("  ", _short(rows[-1]), flush=True)
    return rows


def quota_sweep(args, sms, timing) -> list[dict]:
    """The kernel's GB/s per block quota; the default is the fewest blocks reaching 95% of
    the best."""
    quotas = [1, 2, 3, 4, 6, 8, 16, sms]
    rows = []
    for row_bytes in (256, 1024, 4096):
        pools = pools_for(row_bytes)
        for direction, tokens, page in itertools.product(("h2d", "d2h"), (4096, 32768), (1, 64)):
            found = {}
            for quota in quotas:
                variant = Variant(str(quota), "kernel", options={"block_quota": quota})
                call = rotating(layer_calls(variant, pools, direction, tokens, page))
                call()
                us = common.time_us(call, **timing)
                found[quota] = 2 * tokens * row_bytes / us / 1e3
            best = max(found.values())
            enough = min(q for q, gbps in found.items() if gbps >= 0.95 * best)
            rows.append({"direction": direction, "tokens": tokens, "bytes/token": row_bytes,
                         "page": page, **{f"q{q} GB/s": g for q, g in found.items()},
                         "fewest for 95%": enough})
            print("  ", _short(rows[-1]), flush=True)
    return rows


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        print("bench_hicache: skipped, no CUDA GPU (it times transfers on one)")
        return
    timing = {"warmup_ms": 10, "rep_ms": 40} if args.quick else {}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("device:", common.device_name())
    device_copy = common.device_copy_gbps()
    h2d, d2h = common.pinned_copy_gbps()
    print(f"device copy {device_copy:.0f} GB/s (read+write); pinned copy 256 MiB: "
          f"h2d {h2d:.1f} GB/s, d2h {d2h:.1f} GB/s", flush=True)
    result = {"device": common.device_name(), "device_copy_gbps": device_copy,
              "pinned_h2d_gbps": h2d, "pinned_d2h_gbps": d2h}
    with torch.cuda.stream(torch.cuda.Stream()):  # the GEMMs' stream
        if args.staged and args.peers:
            result["staged_peers"] = staged_peers_table(args)
            if result["staged_peers"]:
                common.print_table("staged write-back, jitk vs SGLang 0.5.23 (ratio: to the "
                                   "d2h copy_ of the same bytes)", result["staged_peers"],
                                   list(result["staged_peers"][0]))
        if args.staged:
            result["staged"] = staged_table(args)
            common.print_table("staged write-back, 64 MiB a call (GB/s of K+V data)",
                               result["staged"], list(result["staged"][0]))
        result["overlap"] = [] if args.skip_overlap else overlap_table(args, sms)
    common.write_json(args.json, result)
    with torch.cuda.stream(torch.cuda.Stream()):
        if args.sweep:
            result["sweep"] = quota_sweep(args, sms, {"warmup_ms": 10, "rep_ms": 40})
            common.print_table("kernel GB/s per block quota (K+V)", result["sweep"],
                               list(result["sweep"][0]))
        if not args.skip_solo:
            result["rows"] = todays_shapes(args, device_copy, timing)
            result["rows"] += host_pool_shapes(args, device_copy, timing)
            if not args.quick:
                result["rows"] += layout_shapes(args, device_copy, timing)
    if "rows" in result:
        common.print_table("solo (ratio = GB/s / ceiling GB/s)", result["rows"],
                           ["direction", "tokens", "bytes/token", "page", "pool", "method",
                            "jitk us", "jitk GB/s", "ceiling GB/s", "ratio",
                            "vs same-size copy", "torch-index us", "graph us"])
    if result["overlap"]:
        common.print_table(f"beside {GEMM[0]} x bf16 {GEMM[1]}^3 GEMMs on the main stream",
                           result["overlap"],
                           ["direction", "tokens", "bytes/token", "page", "method", "gemm ms",
                            "alone GB/s", "beside GB/s", "GEMM slowdown", "vs whole GPU",
                            "layers"])
        print_goal(result["overlap"])
    common.write_json(args.json, result)


def print_goal(rows: list[dict]) -> None:
    """The goals, per method: >= 40 GB/s beside the GEMMs with <= 5% slowdown, for pages of
    >= 64 tokens x >= 1 KiB, and (issue 17, point 4) for pages of 1 and 16 both ways."""
    goals = (("pages >= 64 tokens x >= 1 KiB", lambda r: r["page"] >= 64),
             ("pages of 1 and 16 tokens x >= 1 KiB", lambda r: r["page"] in (1, 16)))
    for title, picks in goals:
        print(f"\ngoal ({title}): beside GB/s >= 40, GEMM slowdown <= 5% (against the GEMMs "
              "alone where they ran)")
        for method in dict.fromkeys(r["method"] for r in rows):
            mine = [r for r in rows if r["method"] == method and picks(r)
                    and r["bytes/token"] >= 1024 and isinstance(r.get("beside GB/s"), float)]
            if mine:
                low = min(r["beside GB/s"] for r in mine)
                worst = max(r["GEMM slowdown"] for r in mine)
                met = "met" if low >= 40 and worst <= 0.05 else "not met"
                print(f"  {method}: lowest {low:.1f} GB/s, worst slowdown {worst:+.1%}: {met}")


if __name__ == "__main__":
    main()
