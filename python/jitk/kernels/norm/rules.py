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
    element bytes, index) and tuning_applies(hidden, element bytes, max_vec_bytes,
    two_vectors)."""
    return load_jit("rmsnorm_rules", cuda_files=["rmsnorm.cuh"],
                    cuda_wrappers=[(name, f"jitk::norm::{cpp}") for name, cpp in (
                        ("knob_count", "rules_knob_count"), ("default_knob", "rules_default_knob"),
                        ("tuning_applies", "tuning_applies"))])
