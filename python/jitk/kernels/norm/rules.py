"""rmsnorm.cuh's rules of a width (hidden size, dtype) that jitk.kernels.norm asks before it
builds or tunes anything: Python copies, since asking the C++ would cost a build. The rules
module exports rmsnorm.cuh's own, and tests/test_rmsnorm.py holds each copy to it at every
width, so a rule changed on one side only fails there."""

from __future__ import annotations

import functools

import torch

from jitk.base.errors import ArgumentError
from jitk.build.jit import load_jit


def default_knobs(bucket: tuple) -> dict:
    """DefaultTuning's knobs (rules_default_knob) at the bucket's (hidden, dtype, ...)."""
    hidden, dtype = bucket[:2]
    return {"row_registers": 4 if hidden * dtype.itemsize < 512 else 16, "prefetch_weight": True,
            "pdl": True, "max_vec_bytes": 16, "register_cap": True, "broadcast_sum": False,
            "pin_offsets": False, "row_first": False, "sum_chains": 1, "late_trigger": False,
            "fill_sm": False, "one_turn": False, "two_vectors": False}


def applies(knobs: dict, hidden: int, dtype: torch.dtype) -> bool:
    """tuning_applies: whether plain rows run the choice's own kernel, not the default's.
    two_vectors where TwoVectors fits (a row a multiple of 1024 bytes, up to 32 KiB); the
    others where an access is more than one element (an even hidden size, a vector of at
    least two)."""
    row_bytes = hidden * dtype.itemsize
    if knobs["two_vectors"]:
        return row_bytes % 1024 == 0 and row_bytes <= 32768
    return hidden % 2 == 0 and knobs["max_vec_bytes"] >= 2 * dtype.itemsize


def vec_size(hidden: int, dtype: torch.dtype, max_vec_bytes: int) -> int:
    """widest_vec_size: the widest access, at most max_vec_bytes, dividing the hidden size."""
    size = max(1, max_vec_bytes // dtype.itemsize)
    while hidden % size:
        size //= 2
    return size


def _base_threads(hidden: int, dtype: torch.dtype, size: int, row_registers: int) -> int:
    """base_threads_per_row (jitk/norm_order.cuh)."""
    vec_registers = max(1, size * dtype.itemsize // 4)
    wanted = -(-(hidden // size) // max(1, row_registers // vec_registers))
    if wanted <= 32:
        return 1 << (wanted - 1).bit_length()
    return min(-(-wanted // 32) * 32, 1024)


def _layout(hidden: int, dtype: torch.dtype, knobs: dict) -> tuple[int, int, int]:
    """(access width, row_spread, the threads of the layout whose order a row keeps): the
    default's (16 registers) for a spread layout, else the choice's own."""
    size = vec_size(hidden, dtype, knobs["max_vec_bytes"])
    registers = knobs["row_registers"]
    if size * dtype.itemsize == 16 and registers in (8, 4):
        base, times = _base_threads(hidden, dtype, size, 16), 16 // registers
        if base >= 32 and hidden // size <= 4 * base and base * times <= 1024:
            return size, times, base
    return size, 1, _base_threads(hidden, dtype, size, registers)


def spread(hidden: int, dtype: torch.dtype, knobs: dict) -> int:
    """rules_row_spread: how many times the default layout's threads the choice spreads a row
    over in the default's order (2 or 4), else 1."""
    return _layout(hidden, dtype, knobs)[1]


def threads_per_row(hidden: int, dtype: torch.dtype, knobs: dict) -> int:
    """rules_threads_per_row: the threads a row of the choice's own kernel spreads over."""
    _, times, threads = _layout(hidden, dtype, knobs)
    return times * threads


def row_order(knobs: dict, hidden: int, dtype: torch.dtype) -> tuple:
    """What fixes the order in which a row's sum of squares is added (docs/developer_guide/
    verifying_and_tuning.md, "Batch invariance"): the access width and the threads of the
    layout whose order a row keeps (a spread layout keeps its base's), the partial sums a
    thread keeps, and TwoVectors' kernel (its own layout and pairwise adds). The other knobs
    change only how rows map to blocks and how the kernel launches; broadcast_sum adds the
    warps' sums in the shuffle's tree."""
    if knobs["two_vectors"]:
        return ("two_vectors",)
    size, _, threads = _layout(hidden, dtype, knobs)
    return size, threads, knobs["sum_chains"]


def keeps_order(knobs: dict, hidden: int, dtype: torch.dtype) -> bool:
    """Whether the choice adds every row in the default's order, so that its bits match."""
    return row_order(knobs, hidden, dtype) == row_order(default_knobs((hidden, dtype)),
                                                         hidden, dtype)


def check_applies(bucket: tuple, knobs: dict) -> None:
    """Refuses, before any build, a choice that would run the default's kernel in its place
    (RMSNorm refuses to build one too)."""
    (hidden, dtype), default = bucket[:2], default_knobs(bucket)
    if knobs != default and not applies(knobs, hidden, dtype):
        changed = ", ".join(f"{k}={v}" for k, v in knobs.items() if v != default[k])
        raise ArgumentError(f"rmsnorm: the tuning ({changed}) does not apply at hidden size "
                            f"{hidden}, {dtype} (rows of {hidden * dtype.itemsize} bytes; "
                            "two_vectors needs a multiple of 1024 up to 32768, the others "
                            "accesses of two or more elements)")


@functools.cache
def module() -> object:
    """rmsnorm.cuh's rules as host functions (no kernel): knob_count(), default_knob(hidden,
    element bytes, index), tuning_applies(hidden, element bytes, max_vec_bytes, two_vectors)
    and threads_per_row and row_spread(hidden, element bytes, max_vec_bytes, row_registers)."""
    return load_jit("rmsnorm_rules", cuda_files=["rmsnorm.cuh"],
                    cuda_wrappers=[(name, f"jitk::norm::{cpp}") for name, cpp in (
                        ("knob_count", "rules_knob_count"), ("default_knob", "rules_default_knob"),
                        ("tuning_applies", "tuning_applies"),
                        ("threads_per_row", "rules_threads_per_row"),
                        ("row_spread", "rules_row_spread"))])
