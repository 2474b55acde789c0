"""What RMSNorm's tuner times: jitk::norm::Tuning's knobs and the changes to the defaults it
tries at each bucket (hidden size, dtype, rows), kept to the default's order of summation
unless JITK_RMSNORM_FAST_UNSTABLE is set. The modules that build them are in __init__."""

from __future__ import annotations

import functools

import torch

from jitk.base import settings
from jitk.kernels.norm.rules import applies, default_knobs, keeps_order

# jitk::norm::Tuning's knobs, in its template order (a test reads that order from
# rmsnorm_tiling.cuh), and the values a tuning file may name.
# Left out of the search: the vector width (16 bytes, SGLang's too, is the widest an H100
# loads). Block 0's weight prefetch pays in short launches where each layer's weight is cold,
# as in a model, and a tuning loop over one weight never shows it, so it is tried off only at
# 256 rows (TRIED_AT_SHORT_LIMIT). PDL is tried off only beside a GEMM (BESIDE_KNOBS): after
# itself it always pays, after a GEMM it can cost short launches. The runs behind each choice
# here: docs/developer_guide/verifying_and_tuning.md, "Measured: RMSNorm on an H100".
KNOBS = {"row_registers": (4, 8, 16), "prefetch_weight": (True, False), "pdl": (True, False),
         "max_vec_bytes": (16,), "register_cap": (True, False),
         "broadcast_sum": (False, True), "pin_offsets": (False, True),
         "row_first": (False, True), "sum_chains": (1, 4), "late_trigger": (False, True),
         "fill_sm": (False, True), "one_turn": (False, True), "two_vectors": (False, True)}

# What the tuner tries, as changes to the defaults (the full product is 3072 modules a width).
# The threads a row (row_registers); SGLang's strategy (a row per block of hidden/16 threads,
# two 16-byte vectors each; the next kernel let launch only at the end); the short critical
# path (offsets before the wait, the row before the weight, the block sum read from shared
# memory), with four partial sums or the late launch; one_turn (no row loop: it pays in short
# launches and loses at 1024 rows, where ptxas then issues the weight's loads after the sum of
# squares); and fill_sm, registers capped so that an SM holds as many blocks as a thread's
# registers allow (SGLang's 768-thread blocks at 12288: two an SM, not one; jitk's 384: three,
# not two). Up to _SHORT_LAUNCH_ROWS rows a launch is latency; past it, a wave or more of
# blocks, where the short path with the loop, fill_sm's occupancy and the late launch (no
# early-launched block of the next kernel holds an SM's room while this one has blocks to
# place) pay. Each combination below was added because a sweep of the knobs' products found it
# level with SGLang or ahead at a shape where the earlier choices trailed; two_vectors is a
# kernel of SGLang's layout written for jitk (rmsnorm_kernels.cuh, TwoVectors), tried past 256
# rows at the widths it fits (only with JITK_RMSNORM_FAST_UNSTABLE, below). As written, a set is
# 10 to 14 of a width's 19 choices (with TRIED_AT_SHORT_LIMIT); kept in the default's order, fewer
# (9 to 11 of 15 at 4096 bf16, where 8 and 4 registers keep it). A width's choices share a module
# (__init__'s candidate_kernels), so that tuning the benchmark's shapes stays short.
_SHORT_PATH = {"broadcast_sum": True, "pin_offsets": True, "row_first": True}
_FOUR_SUMS = {"sum_chains": 4}
_LATE = {"late_trigger": True}
_SGLANG_LIKE = {"row_registers": 8, **_LATE}
_ONE_TURN = {"one_turn": True}
_FILL_SM = {"fill_sm": True}
TRIED = ({"row_registers": 4, **_ONE_TURN}, {**_SGLANG_LIKE, **_FILL_SM, **_ONE_TURN},
         {**_SHORT_PATH, **_FOUR_SUMS, **_ONE_TURN}, {**_SHORT_PATH, **_LATE, **_ONE_TURN})
TRIED_SHORT = ({**_SGLANG_LIKE, **_ONE_TURN}, {"row_registers": 8, **_SHORT_PATH, **_ONE_TURN},
               {"row_registers": 8, **_SHORT_PATH, **_FOUR_SUMS, **_ONE_TURN},
               {**_SGLANG_LIKE, **_SHORT_PATH, **_FOUR_SUMS, **_ONE_TURN},
               {**_SGLANG_LIKE, **_SHORT_PATH, **_ONE_TURN},
               {"row_registers": 4, "row_first": True, **_LATE, **_ONE_TURN},
               {"row_registers": 8, **_SHORT_PATH, **_FILL_SM, **_ONE_TURN})
_TWO_VECTORS = {"two_vectors": True}
TRIED_LONG = (_SHORT_PATH, {**_SHORT_PATH, **_LATE}, {**_SHORT_PATH, **_FILL_SM},
              {**_SHORT_PATH, **_FOUR_SUMS, **_FILL_SM, **_ONE_TURN},
              {"row_registers": 8, **_FILL_SM}, _TWO_VECTORS)
_SHORT_LAUNCH_ROWS = 256
# At 256 rows, the largest short launch bucket, block 0's weight prefetch can cost single
# calls more than it saves (the best products of the prefetch and the short path's knobs there
# left it out), so one choice there leaves it out. Past 256 rows it won only within the
# benchmark's noise and lengthened tuning, so it is not tried there.
TRIED_AT_SHORT_LIMIT = ({**_SGLANG_LIKE, **_FILL_SM, **_ONE_TURN, "pin_offsets": True,
                         "prefetch_weight": False},)


# Batch invariance: a row's bits must not depend on the row count, and each bucket of rows
# may get its own choice, so every choice the tuner times adds a row in the default's order
# (rules.keeps_order: the same access width, the default's threads a row or a spread of them
# (8 or 4 registers where the default gives a row whole warps: jitk/norm_order.cuh), one sum
# a thread, not TwoVectors' kernel). A tried change that would add in another order is timed
# with those knobs at the default's values and its launch changes kept, but fill_sm, whose
# register plan was chosen for the threads it was tried with (left on, it spilled under ptxas
# at 8192 with the default's 16 registers, sm_90). JITK_RMSNORM_FAST_UNSTABLE=1 times the
# changes as written, giving up invariance (docs/developer_guide/verifying_and_tuning.md,
# "Batch invariance"); it is read when a bucket's candidates are first worked out.
FAST_UNSTABLE_ENV = "JITK_RMSNORM_FAST_UNSTABLE"
_PUT_BACK = ("row_registers", "max_vec_bytes", "sum_chains", "two_vectors", "fill_sm")


def unstable_allowed() -> bool:
    return settings.flag(FAST_UNSTABLE_ENV)


def _as_tried(changes: dict, hidden: int, dtype: torch.dtype, unstable: bool) -> dict | None:
    """A tried change's knobs as the tuner times them at a width (see above); None where the
    choice would run the default's kernel in its place (rules.applies)."""
    default = default_knobs((hidden, dtype))
    knobs = {**default, **changes}
    if not unstable and not keeps_order(knobs, hidden, dtype):
        knobs = {**knobs, **{name: default[name] for name in _PUT_BACK}}
    return knobs if knobs == default or applies(knobs, hidden, dtype) else None


def tried(bucket: tuple, knobs: dict) -> bool:
    """Whether the tuner times `knobs` at `bucket` (the default always)."""
    return knob_values(knobs) in tried_values(*bucket[:3], unstable_allowed())


@functools.cache
def tried_values(hidden: int, dtype: torch.dtype, rows: int,
                 unstable: bool = False) -> frozenset[tuple]:
    """The knob values of every choice the tuner times at a bucket: a set, since the tuning
    space asks about each of its knobs' 3072 combinations."""
    changes_tried = ({}, *TRIED, *(TRIED_SHORT if rows <= _SHORT_LAUNCH_ROWS else TRIED_LONG),
                     *(TRIED_AT_SHORT_LIMIT if rows == _SHORT_LAUNCH_ROWS else ()))
    choices = (_as_tried(changes, hidden, dtype, unstable) for changes in changes_tried)
    return frozenset(knob_values(knobs) for knobs in choices if knobs is not None)


def knob_values(knobs: dict) -> tuple:
    """jitk::norm::Tuning's template arguments."""
    return tuple(knobs[name] for name in KNOBS)


BESIDE_KNOBS = ("pdl",)


@functools.cache
def candidates(hidden: int, dtype: torch.dtype, pdl: bool = True,
               unstable: bool = False) -> tuple[dict, ...]:
    """Every choice the tuner may time at a width and dtype with PDL (or, the default too,
    without) but the default, in one order (a candidates module's); not to be modified."""
    default = default_knobs((hidden, dtype))
    choices = [default]
    for changes in (*TRIED, *TRIED_SHORT, *TRIED_LONG, *TRIED_AT_SHORT_LIMIT):
        knobs = _as_tried(changes, hidden, dtype, unstable)
        if knobs is not None and knobs not in choices:
            choices.append(knobs)
    return tuple(knobs for knobs in ({**c, "pdl": pdl} for c in choices) if knobs != default)
