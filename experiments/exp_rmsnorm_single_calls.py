"""Issue #39: the decode cells where jitk's single calls trail SGLang 0.5.23 (1x8192, 16x8192,
fused fp16 256x7168 and 256x8192): every choice of the invariant space, with PDL and without,
timed beside SGLang in both of bench_rmsnorm_peers.py's modes (graph replay of 10-call
chains; one call alone), in one process. Is there a choice at or below SGLang in both, which
a tuner that also weighed single calls would pick?

    PYTHONPATH=benchmarks:.peers/sgl523 python experiments/exp_rmsnorm_single_calls.py
"""

import statistics
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
from bench_rmsnorm_peers import EPS, providers, rounds_over_sets, tensors

from jitk.kernels import norm
from jitk.kernels.norm import tuning

SHAPES = (("rmsnorm", torch.bfloat16, 1, 8192), ("rmsnorm", torch.bfloat16, 16, 8192),
          ("rmsnorm", torch.float16, 1, 8192), ("fused_add_rmsnorm", torch.float16, 256, 8192),
          ("fused_add_rmsnorm", torch.float16, 256, 7168))
ROUNDS, SETS = 24, 2


def choice_calls(op: str, hidden: int, dtype: torch.dtype) -> dict:
    """'name' -> kernels of the default and of every candidate, with PDL and without."""
    calls = {"default": norm._kernels(hidden, dtype)}
    for pdl in (True, False):
        module = norm._candidate_kernels(hidden, dtype, pdl, False)
        for knobs, kernels in zip(tuning.candidates(hidden, dtype, pdl), module):
            default = norm._default_knobs((hidden, dtype))
            name = ",".join(f"{k}={v}" for k, v in knobs.items() if v != default[k]) or "pdl"
            calls[name] = kernels
    return calls


def main():
    import sgl523
    sgl523.build_all(element_sizes=(), hidden_sizes=(7168, 8192),
                     dtypes=(torch.bfloat16, torch.float16))
    widths = {(hidden, dtype) for _, dtype, _, hidden in SHAPES}
    with ThreadPoolExecutor(max_workers=8) as pool:  # every module built up front
        list(pool.map(lambda job: job(), [
            *(partial(norm._kernels, h, d) for h, d in widths),
            *(partial(norm._candidate_kernels, h, d, pdl, False) for h, d in widths
              for pdl in (True, False))]))
    for op, dtype, rows, hidden in SHAPES:
        choices = choice_calls(op, hidden, dtype)
        tuned = (norm._RMSNORM_SPACE if op == "rmsnorm" else norm._FUSED_SPACE).config(
            (hidden, dtype, rows))

        def calls_on(t, choices=choices, op=op):
            placement = "in place" if op == "fused_add_rmsnorm" else "out of place"
            own = {"sglang": providers(sgl523, op, placement, t)["sglang"]}
            for name, kernels in choices.items():
                if op == "fused_add_rmsnorm":
                    own[name] = lambda w, k=kernels: lambda: k.fused_add_rmsnorm(
                        t["x"], t["residual"], w, EPS)
                else:
                    own[name] = lambda w, k=kernels: lambda: k.rmsnorm(t["x"], w, t["out"], EPS)
            return own

        sets = [tensors(rows, hidden, dtype) for _ in range(SETS)]
        medians = {mode: {name: statistics.median(us) for name, us in rounds_over_sets(
            calls_on, sets, mode, ROUNDS, flush=None).items()} for mode in ("graph", "single")}
        print(f"\n{op} {str(dtype)[6:]} {rows}x{hidden}; tuned: {tuned}")
        sgl = {mode: medians[mode]["sglang"] for mode in medians}
        print(f"  sglang: graph {sgl['graph']:.3f} us, single {sgl['single']:.3f} us")
        ranked = sorted((n for n in medians["graph"] if n != "sglang"),
                        key=lambda n: max(medians[m][n] / sgl[m] for m in sgl))
        for name in ranked:
            print(f"  graph {medians['graph'][name] / sgl['graph']:.3f}  single "
                  f"{medians['single'][name] / sgl['single']:.3f}  {name}")


if __name__ == "__main__":
    main()
