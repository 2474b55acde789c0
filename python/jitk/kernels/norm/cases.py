"""RMSNorm's parity cases (jitk.op's `cases`): what `python -m jitk check` and the parity tests
run each entry point on, against its float32 reference."""

from __future__ import annotations

import torch

# (rows, hidden): one row, odd counts (a block's last turn part empty), an odd hidden size
# (element-wise path), q/k-norm's 128, model widths, and rows read twice (past 1024 threads x
# 16 registers); each as a contiguous tensor, a slice of wider rows, and heads of a QKV buffer.
SHAPES = ((1, 4096), (77, 5120), (3, 7), (33, 128), (5, 12288), (2, 65536 + 8))
LAYOUTS = ("contiguous", "strided rows", "qkv heads")


def _rows(layout: str, rows: int, hidden: int, dtype: torch.dtype,
          device: torch.device) -> torch.Tensor:
    if layout == "strided rows":
        return torch.randn(rows, hidden + 24, device=device).to(dtype)[:, 8:8 + hidden]
    if layout == "qkv heads":
        return torch.randn(rows, 3, 2, hidden, device=device).to(dtype)[:, 0]
    return torch.randn(rows, hidden, device=device).to(dtype)


def parity_cases(entry: str, dtypes: tuple[torch.dtype, ...]) -> list:
    """The cases of `entry` ("rmsnorm" or "fused_add_rmsnorm") in each of `dtypes`: every
    shape in every layout; rmsnorm in place too, and the fused form with float_sum on
    contiguous rows."""
    from jitk.tools.testing import Case

    cases = []
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        for rows, hidden in SHAPES:
            for layout in LAYOUTS:
                for float_sum in (False, True) if entry != "rmsnorm" else (False,):
                    if float_sum and layout != "contiguous":
                        continue

                    def make(device, rows=rows, hidden=hidden, dtype=dtype, layout=layout,
                             float_sum=float_sum):
                        x = _rows(layout, rows, hidden, dtype, device)
                        weight = torch.randn(hidden, device=device).to(dtype)
                        if entry == "rmsnorm":
                            return (x, weight, torch.empty_like(x), 1e-6), {}
                        kwargs = {"eps": 1e-5, **({"float_sum": True} if float_sum else {})}
                        return (x, torch.randn_like(x), weight), kwargs

                    label = f"{name} {rows}x{hidden} {layout}" + (" float_sum" if float_sum
                                                                  else "")
                    cases.append(Case(label, make, ("out",) if entry == "rmsnorm" else ()))
        if entry == "rmsnorm":  # in place: out is the input
            def in_place(device, dtype=dtype):
                x = torch.randn(9, 4096, device=device).to(dtype)
                return (x, torch.randn(4096, device=device).to(dtype), x, 1e-6), {}
            cases.append(Case(f"{name} 9x4096 in place", in_place, ("out",)))
    return cases
