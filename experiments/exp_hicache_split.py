"""HiCache's kernel on SMs of its own beside a GEMM on the others (issue 17, point 4).

The GPU is split with jitk.split_sms (two green contexts from one split, so no SM is in both):
the load-back / write-back kernel runs on the small partition (one block per SM, or fewer for
write-backs), the 12 bf16 8192^3 GEMMs of bench_hicache.py on the rest. Per row: the transfer
alone on its partition, beside the GEMMs, and the GEMMs' time against the GEMMs alone on the
rest (same rounds) and on the whole GPU (measured right after, the same way). For reference,
the same kernel with 8 blocks on the whole GPU beside the GEMMs there (no split). Pages of 1
and 16 tokens of 1 KiB (K and V), 4096 tokens a layer.

    python benchmarks/exp_hicache_split.py [--quick] [--json PATH]
"""

from __future__ import annotations

import statistics


import torch  # noqa: E402
from common import device_name, parse_args, print_table, write_json  # noqa: E402
from hicache_calls import Variant, layer_calls, pools_for  # noqa: E402
from hicache_timing import gemm_alone_ms, make_gemm, overlap_row, run_layers  # noqa: E402

import jitk  # noqa: E402

TOKENS, ROW_BYTES = 4096, 1024


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    rounds = 2 if args.quick else 3
    torch.manual_seed(0)
    gemm = make_gemm()
    whole_ms = gemm_alone_ms(gemm)
    pools = pools_for(ROW_BYTES)
    layer_bytes = 2 * TOKENS * ROW_BYTES
    rows = []
    side = torch.cuda.Stream()
    def whole_alone() -> float:
        """The GEMMs alone on the whole GPU, measured as overlap_row measures them (short
        bursts with gaps: sustained GEMMs run slower as clocks settle)."""
        return statistics.median(run_layers([], 0, [], gemm)[1] for _ in range(3))

    for sms, quotas in ((8, (2, 4, 5, 6, 8)), (16, (16,))):
        split = jitk.split_sms(sms)
        with torch.cuda.stream(split.rest):
            rest_ms = gemm_alone_ms(gemm)
        for direction in ("h2d", "d2h"):
            for page in (1, 16):
                for blocks in quotas if direction == "d2h" else quotas[-1:]:
                    variant = Variant("kernel", "kernel", options={"block_quota": blocks})
                    calls = layer_calls(variant, pools, direction, TOKENS, page)
                    shape = {"direction": direction, "page": page, "blocks": blocks}
                    with torch.cuda.stream(split.rest):
                        row = overlap_row(f"split: {split.own_sms} SMs / {split.rest_sms}",
                                          calls, layer_bytes, [split.own], gemm, rest_ms, rounds)
                    beside_ms = row["gemm ms"] * (1 + row["GEMM slowdown"])
                    row["GEMM vs whole GPU"] = beside_ms / whole_alone() - 1
                    rows.append({**shape, **row})
                    print("  ", rows[-1], flush=True)
                    if sms == 8 and blocks == 8:
                        row = overlap_row("whole GPU, no split", calls, layer_bytes, [side],
                                          gemm, whole_ms, rounds)
                        row["GEMM vs whole GPU"] = row["GEMM slowdown"]
                        rows.append({**shape, **row})
                        print("  ", rows[-1], flush=True)
        torch.cuda.synchronize()
        split.close()
    print(f"{device_name()}; GEMMs alone on the whole GPU {whole_ms:.2f} ms")
    print_table("HiCache kernel beside 12 bf16 8192^3 GEMMs, 4096 tokens x 1 KiB (K+V)", rows,
                ["direction", "page", "blocks", "method", "gemm ms", "alone GB/s",
                 "beside GB/s", "GEMM slowdown", "GEMM vs whole GPU"])
    write_json(args.json, {"device": device_name(), "whole_gemm_ms": whole_ms, "rows": rows})


if __name__ == "__main__":
    main()
