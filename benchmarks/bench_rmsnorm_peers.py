"""jitk.rmsnorm against SGLang 0.5.23's own RMSNorm, in one process, on the same tensors.

Out of place (x -> out), bf16, rows x hidden over decode and prefill sizes. Each figure is us
per call under CUDA graph replay of 10-call chains: the providers' graphs are replayed in
turn, round after round, and each figure is the median of its rounds. Both results are
checked against torch (float32) first. jitk runs what a lookup picks: the tuned choice from
the tuning file (`python -m jitk tune`), else the default. Needs SGLang's kernels:
PYTHONPATH=.peers/sgl523 (see ../shared/peers/README.md).
    python benchmarks/bench_rmsnorm_peers.py [--quick] [--json PATH]"""

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import jitk  # noqa: E402
import jitk.norm  # noqa: E402  (registers the operator)

ROWS = (1, 16, 77, 256, 1024, 4096)
HIDDENS = (4096, 5120, 7168, 8192, 12288)
CALLS, ROUNDS = 10, 15
EPS = 1e-6


def measure(sgl523, space, rows: int, hidden: int) -> dict:
    x = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16)
    weight = torch.randn(hidden, device="cuda").to(torch.bfloat16)
    outs = {"jitk": torch.empty_like(x), "sglang": torch.empty_like(x)}
    calls = {"jitk": lambda: jitk.rmsnorm(x, weight, out=outs["jitk"], eps=EPS),
             "sglang": lambda: sgl523.rmsnorm(x, weight, outs["sglang"], EPS)}
    expected = torch.nn.functional.rms_norm(x.float(), (hidden,), weight.float(), EPS)
    for name, call in calls.items():
        call()
        torch.testing.assert_close(outs[name].float(), expected, rtol=2e-2, atol=2e-2,
                                   msg=lambda m, name=name: f"{name}: {m}")
    graphs = {name: common.captured_graph(call, CALLS) for name, call in calls.items()}
    samples = {name: [] for name in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(ROUNDS):
        for name, graph in graphs.items():
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) * 1e3 / CALLS)
    us = {name: statistics.median(s) for name, s in samples.items()}
    knobs = space.config(space.bucket(x, weight, outs["jitk"], EPS))
    return {"shape": f"{rows}x{hidden}",
            "jitk knobs": "r{row_registers}{cap}{sum}".format(
                cap="" if knobs["register_cap"] else " nocap",
                sum="" if knobs["broadcast_sum"] else " shfl", **knobs),
            "jitk us": us["jitk"], "sglang us": us["sglang"],
            "jitk/sglang": us["jitk"] / us["sglang"],
            "jitk <= sglang": "yes" if us["jitk"] <= us["sglang"] else "NO"}


def main():
    args = common.parse_args(__doc__)
    import sgl523  # SGLang's kernels; fails here, with its own message, when not set up

    print("device:", common.device_name())
    space = jitk.custom_op.find_op("jitk::rmsnorm").tuning
    results = [measure(sgl523, space, rows, hidden) for hidden in HIDDENS
               for rows in ((16, 1024) if args.quick else ROWS)]
    common.print_table(f"rmsnorm bf16 out of place, us per call (graph replay of {CALLS}-call "
                       f"chains, median of {ROUNDS} interleaved rounds)", results,
                       ["shape", "jitk knobs", "jitk us", "sglang us", "jitk/sglang",
                        "jitk <= sglang"])
    wins = sum(r["jitk <= sglang"] == "yes" for r in results)
    print(f"jitk <= SGLang at {wins} of {len(results)} shapes")
    common.write_json(args.json, {"device": common.device_name(), "rows": results})


if __name__ == "__main__":
    main()
