"""RMSNorm over the last dimension, and its fused residual form.

    y = rmsnorm(x, weight)                 # in place: x is normalised and returned
    y = rmsnorm(x, weight, out=y)          # into `out`
    fused_add_rmsnorm(x, residual, weight) # residual += x; x = rmsnorm(residual) * weight

rmsnorm(x) = x / sqrt(mean(x^2) + eps) * weight, accumulated in float32 and rounded to the
input dtype (float32, float16 or bfloat16). `x` may have any leading shape: its leading
dimensions number the rows, and may step through memory with up to two strides, so a slice
of rows, or of a wider last dimension, qualifies, and so do heads cut from a fused QKV
buffer (q/k-norm over `qkv[:, :q_size].view(tokens, heads, head_dim)`, strides
`(qkv_width, head_dim, 1)`). The last dimension must be contiguous. `out` (and `residual`)
need the same number of rows and hidden size, each with strides of its own. `weight` is a
contiguous 1-d tensor of the hidden size and the input's dtype.

fused_add_rmsnorm keeps the sum in the residual's dtype and normalises the sum as stored,
so afterwards `x` equals rmsnorm(residual, weight) exactly.

Both launch on PyTorch's current stream, allocate nothing and never synchronise, so they
can be captured in a CUDA graph. Arguments are checked before any module is built: a wrong
type, a hidden size or an eps the kernel cannot take raises here and builds nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from jitk.base import settings
from jitk.base.errors import ArgumentError, ArgumentTypeError
from jitk.build.cpp_args import make_cpp_args
from jitk.build.jit import load_jit
from jitk.kernels.norm.rules import applies as _applies
from jitk.kernels.norm.rules import check_applies as _check_applies
from jitk.kernels.norm.rules import default_knobs as _default_knobs
from jitk.kernels.norm.rules import keeps_order as _keeps_order
from jitk.runtime.op import Tolerance, op
from jitk.tools import api_log
from jitk.tools.autotune import TuningSpace
from jitk.tools.timing import gemm_neighbour

__all__ = ["fused_add_rmsnorm", "instantiation", "precompile_configs", "rmsnorm",
           "tuning_choices"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HIDDEN = 2**30  # jitk::norm::kMaxHidden (rmsnorm.cuh); a test builds the largest
_FLOAT32_MAX = 3.4028234663852886e38  # eps travels to the kernel as a float32


class _Kernels(NamedTuple):
    rmsnorm: Callable
    fused_add_rmsnorm: Callable


def _check_kernel_args(hidden: int, dtype: torch.dtype) -> None:
    if dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"rmsnorm supports float32, float16 and bfloat16 inputs, got {dtype}")
    if not 1 <= hidden <= _MAX_HIDDEN:
        raise ValueError(f"rmsnorm needs a hidden size (last dimension) of 1 to {_MAX_HIDDEN}, "
                         f"got {hidden}")


def _load(name: str, hidden: int, dtype: torch.dtype, *tunings: tuple) -> list[_Kernels]:
    """One module of both entry points at each tuning (knob values in _KNOBS's order), or
    at rmsnorm.cuh's DefaultTuning when none is given."""
    _check_kernel_args(hidden, dtype)
    args = make_cpp_args(hidden, dtype)
    norms = [_norm_type(hidden, dtype, t) for t in tunings] or [_norm_type(hidden, dtype)]
    suffixes = [f"_{i}" for i in range(len(tunings))] if len(tunings) > 1 else [""]
    module = load_jit(
        name, *args, *(make_cpp_args(*tunings[0]) if len(tunings) == 1 else ()),
        cuda_files=["rmsnorm.cuh"],
        cuda_wrappers=[wrapper for norm, suffix in zip(norms, suffixes) for wrapper in (
            (f"rmsnorm{suffix}", f"{norm}::run"),
            (f"fused_add_rmsnorm{suffix}", f"{norm}::run_fused_add"))],
    )
    # Fetched once: a module attribute lookup goes through the FFI each time.
    return [_Kernels(getattr(module, f"rmsnorm{suffix}"),
                     getattr(module, f"fused_add_rmsnorm{suffix}")) for suffix in suffixes]


def _norm_type(hidden: int, dtype: torch.dtype, tuning: tuple | None = None) -> str:
    """The C++ instantiation at a tuning (knob values in _KNOBS's order), else the default's;
    its dtype is written unqualified (bf16_t), as load_jit's sources declare it."""
    args = make_cpp_args(hidden, dtype)
    if tuning is None:
        return f"jitk::norm::RMSNorm<{args}>"
    return f"jitk::norm::RMSNorm<{args}, jitk::norm::Tuning<{make_cpp_args(*tuning)}>>"


@functools.cache
def _kernels(hidden: int, dtype: torch.dtype) -> _Kernels:
    """The module for one hidden size and dtype with the default launch knobs (rmsnorm.cuh's
    DefaultTuning); raises before building for ones it lacks."""
    return _load("rmsnorm", hidden, dtype)[0]


# ---------------------------------------------------------------------------- tuning
# jitk::norm::Tuning's knobs, in its template order (a test reads that order from rmsnorm.cuh),
# and the values a tuning file may name.
# Left out of the search: the vector width (16 bytes, SGLang's too, is the widest an H100
# loads). Block 0's weight prefetch pays in short launches where each layer's weight is cold,
# as in a model, and a tuning loop over one weight never shows it, so it is tried off only at
# 256 rows (_TRIED_AT_SHORT_LIMIT). PDL is tried off only beside a GEMM (_BESIDE_KNOBS): after
# itself it always pays, after a GEMM it can cost short launches. The runs behind each choice
# here: docs/developer_guide/verifying_and_tuning.md, "Measured: RMSNorm on an H100".
_KNOBS = {"row_registers": (4, 8, 16), "prefetch_weight": (True, False), "pdl": (True, False),
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
# kernel of SGLang's layout written for jitk (rmsnorm.cuh, TwoVectors), tried past 256 rows at
# the widths it fits (only with JITK_RMSNORM_FAST_UNSTABLE, below). As written, a set is 10 to
# 14 of a width's 19 choices (with _TRIED_AT_SHORT_LIMIT); kept in the default's order, fewer
# (6 to 8 with the default at 4096 bf16). A width's choices share a module
# (_candidate_kernels), so that tuning the benchmark's shapes stays short.
_SHORT_PATH = {"broadcast_sum": True, "pin_offsets": True, "row_first": True}
_FOUR_SUMS = {"sum_chains": 4}
_LATE = {"late_trigger": True}
_SGLANG_LIKE = {"row_registers": 8, **_LATE}
_ONE_TURN = {"one_turn": True}
_FILL_SM = {"fill_sm": True}
_TRIED = ({"row_registers": 4, **_ONE_TURN}, {**_SGLANG_LIKE, **_FILL_SM, **_ONE_TURN},
          {**_SHORT_PATH, **_FOUR_SUMS, **_ONE_TURN}, {**_SHORT_PATH, **_LATE, **_ONE_TURN})
_TRIED_SHORT = ({**_SGLANG_LIKE, **_ONE_TURN}, {"row_registers": 8, **_SHORT_PATH, **_ONE_TURN},
                {"row_registers": 8, **_SHORT_PATH, **_FOUR_SUMS, **_ONE_TURN},
                {**_SGLANG_LIKE, **_SHORT_PATH, **_FOUR_SUMS, **_ONE_TURN},
                {**_SGLANG_LIKE, **_SHORT_PATH, **_ONE_TURN},
                {"row_registers": 4, "row_first": True, **_LATE, **_ONE_TURN},
                {"row_registers": 8, **_SHORT_PATH, **_FILL_SM, **_ONE_TURN})
_TWO_VECTORS = {"two_vectors": True}
_TRIED_LONG = (_SHORT_PATH, {**_SHORT_PATH, **_LATE}, {**_SHORT_PATH, **_FILL_SM},
               {**_SHORT_PATH, **_FOUR_SUMS, **_FILL_SM, **_ONE_TURN},
               {"row_registers": 8, **_FILL_SM}, _TWO_VECTORS)
_SHORT_LAUNCH_ROWS = 256
# At 256 rows, the largest short launch bucket, block 0's weight prefetch can cost single
# calls more than it saves (the best products of the prefetch and the short path's knobs there
# left it out), so one choice there leaves it out. Past 256 rows it won only within the
# benchmark's noise and lengthened tuning, so it is not tried there.
_TRIED_AT_SHORT_LIMIT = ({**_SGLANG_LIKE, **_FILL_SM, **_ONE_TURN, "pin_offsets": True,
                          "prefetch_weight": False},)


# Batch invariance: a row's bits must not depend on the row count, and each bucket of rows
# may get its own choice, so every choice the tuner times adds a row in the default's order
# (rules.keeps_order: the same access width, threads a row and partial sums a thread, not
# TwoVectors' kernel). A tried change that would add in another order is timed with those
# knobs at the default's values and its launch changes kept, but fill_sm, whose register plan
# was chosen for the threads it was tried with (left on, it spilled under ptxas at 8192 with
# the default's 16 registers, sm_90). JITK_RMSNORM_FAST_UNSTABLE=1
# times the changes as written, giving up invariance (docs/developer_guide/
# verifying_and_tuning.md, "Batch invariance"); it is read when a bucket's candidates are
# first worked out.
FAST_UNSTABLE_ENV = "JITK_RMSNORM_FAST_UNSTABLE"
_PUT_BACK = ("row_registers", "max_vec_bytes", "sum_chains", "two_vectors", "fill_sm")


def _unstable_allowed() -> bool:
    return settings.flag(FAST_UNSTABLE_ENV)


def _as_tried(changes: dict, hidden: int, dtype: torch.dtype, unstable: bool) -> dict | None:
    """A tried change's knobs as the tuner times them at a width (see above); None where the
    choice would run the default's kernel in its place (rules.applies)."""
    default = _default_knobs((hidden, dtype))
    knobs = {**default, **changes}
    if not unstable and not _keeps_order(knobs, hidden, dtype):
        knobs = {**knobs, **{name: default[name] for name in _PUT_BACK}}
    return knobs if knobs == default or _applies(knobs, hidden, dtype) else None


def _tried(bucket: tuple, knobs: dict) -> bool:
    """Whether the tuner times `knobs` at `bucket` (the default always)."""
    return _knob_values(knobs) in _tried_values(*bucket[:3], _unstable_allowed())


@functools.cache
def _tried_values(hidden: int, dtype: torch.dtype, rows: int,
                  unstable: bool = False) -> frozenset[tuple]:
    """The knob values of every choice the tuner times at a bucket: a set, since the tuning
    space asks about each of its knobs' 3072 combinations."""
    tried = ({}, *_TRIED, *(_TRIED_SHORT if rows <= _SHORT_LAUNCH_ROWS else _TRIED_LONG),
             *(_TRIED_AT_SHORT_LIMIT if rows == _SHORT_LAUNCH_ROWS else ()))
    choices = (_as_tried(changes, hidden, dtype, unstable) for changes in tried)
    return frozenset(_knob_values(knobs) for knobs in choices if knobs is not None)


def _knob_values(knobs: dict) -> tuple:
    """jitk::norm::Tuning's template arguments."""
    return tuple(knobs[name] for name in _KNOBS)


_BESIDE_KNOBS = ("pdl",)


@functools.cache
def _candidates(hidden: int, dtype: torch.dtype, pdl: bool = True,
                unstable: bool = False) -> tuple[dict, ...]:
    """Every choice the tuner may time at a width and dtype with PDL (or, the default too,
    without) but the default, in one order (a candidates module's); not to be modified."""
    default = _default_knobs((hidden, dtype))
    choices = [default]
    for changes in (*_TRIED, *_TRIED_SHORT, *_TRIED_LONG, *_TRIED_AT_SHORT_LIMIT):
        knobs = _as_tried(changes, hidden, dtype, unstable)
        if knobs is not None and knobs not in choices:
            choices.append(knobs)
    return tuple(knobs for knobs in ({**c, "pdl": pdl} for c in choices) if knobs != default)


def tuning_choices(hidden: int, dtype: torch.dtype) -> list[tuple[dict, Callable[[], _Kernels]]]:
    """The default's knobs, then every other choice the tuner may pick at some row count of
    a width and dtype, each with a function that builds (or loads) its entry points
    (rmsnorm(input, weight, out, eps), fused_add_rmsnorm(input, residual, weight, eps)): what
    `python -m jitk check --invariance` holds to the default's bits."""
    _check_kernel_args(hidden, dtype)
    choices = (_default_knobs((hidden, dtype)),
               *_candidates(hidden, dtype, True, _unstable_allowed()))
    return [(knobs, functools.partial(_kernels_with, (hidden, dtype), knobs)) for knobs in choices]


# The candidates of a width and dtype share one module (those without PDL, tried only beside a
# GEMM, another): building them one module each took an H100 host's 16 cores 50 s for the
# benchmark's 10 widths and dtypes, most of it the front end that each build repeats. A choice
# outside them (a file from another jitk) gets its own.
@functools.cache
def _candidate_kernels(hidden: int, dtype: torch.dtype, pdl: bool = True,
                       unstable: bool = False) -> list[_Kernels]:
    name = "rmsnorm_candidates" + ("_unstable" if unstable else "") + ("" if pdl else "_no_pdl")
    return _load(name, hidden, dtype,
                 *(_knob_values(knobs) for knobs in _candidates(hidden, dtype, pdl, unstable)))


@functools.cache
def _tuned_kernels(hidden: int, dtype: torch.dtype, tuning: tuple) -> _Kernels:
    return _load("rmsnorm_tuned", hidden, dtype, tuning)[0]


def _candidate_index(bucket: tuple, knobs: dict) -> int | None:
    """The place of `knobs` in its candidates module (with PDL or without), if it has one."""
    candidates = _candidates(*bucket[:2], knobs["pdl"], _unstable_allowed())
    return candidates.index(knobs) if knobs in candidates else None


def _kernels_with(bucket: tuple, knobs: dict) -> _Kernels:
    _check_applies(bucket, knobs)
    hidden, dtype = bucket[:2]
    if knobs == _default_knobs(bucket):
        return _kernels(hidden, dtype)
    index = _candidate_index(bucket, knobs)
    if index is not None:
        return _candidate_kernels(hidden, dtype, knobs["pdl"], _unstable_allowed())[index]
    return _tuned_kernels(hidden, dtype, _knob_values(knobs))


def _module_key(bucket: tuple, knobs: dict) -> tuple:
    """What _kernels_with builds: a module a hidden size and dtype for the default, one for
    the tuner's candidates with PDL and one for those without, one for any other choice;
    each holds both entry points."""
    hidden, dtype = bucket[:2]
    if knobs == _default_knobs(bucket):
        return ("jitk.kernels.norm", hidden, dtype, "default")
    if _candidate_index(bucket, knobs) is not None:
        return ("jitk.kernels.norm", hidden, dtype, "candidates" if knobs["pdl"] else
                "candidates without PDL", _unstable_allowed())
    return ("jitk.kernels.norm", hidden, dtype, *_knob_values(knobs))


def _rows_bucket(input: torch.Tensor, hidden: int) -> int:
    """The row count rounded up to a power of two: tuned choices are kept per bucket."""
    return 1 << (input.numel() // hidden - 1).bit_length() if hidden else 1


# Argument types are checked by the operator layer (jitk.op) before the bodies below run;
# the values the kernel cannot take are refused here, before any module is built. This is
# every eager call's path: one Python call, the eps check, one dict lookup by exact shape and
# placement (the tuning space's call cache) and the call log's flag; the shape bucket is
# worked out only for a new shape or a logged call.
def _kernel_for(space: TuningSpace, function: str, input: torch.Tensor, eps: float,
                in_place: bool = False) -> Callable:
    if not 0.0 <= eps <= _FLOAT32_MAX:  # NaN fails both comparisons
        raise ValueError(f"{function}: 'eps' must be finite and >= 0 as a float32 (at most "
                         f"{_FLOAT32_MAX:.7g}), got {eps!r}")
    kernel = space.calls.get((input.shape, input.dtype, in_place))
    if kernel is None:
        kernel = space.calls[input.shape, input.dtype, in_place] = space.lookup(
            _bucket(function, input, in_place))
    if api_log.noting:  # every logged call, not only a shape's first
        _note_choice(function, _bucket(function, input, in_place))
    return kernel


def _bucket(function: str, input: torch.Tensor, in_place: bool = False) -> tuple:
    """(hidden, dtype, rows rounded up to a power of two), then "in place" for rmsnorm
    writing its input: writing the lines it reads favours other choices."""
    try:
        hidden = input.shape[-1]
    except IndexError:
        raise ValueError(f"{function}: 'input' is a 0-d tensor; it needs a last dimension "
                         "(the hidden size)") from None
    bucket = hidden, input.dtype, _rows_bucket(input, hidden)
    return (*bucket, "in place") if in_place else bucket


def _note_choice(function: str, bucket: tuple) -> None:
    """The call log's note (JITK_LOGLEVEL=3): the instantiation and the knobs it runs with."""
    hidden, dtype, rows = bucket[:3]
    space = _RMSNORM_SPACE if function == "rmsnorm" else _FUSED_SPACE
    knobs = space.config(bucket)
    api_log.note(kernel=f"jitk::norm::RMSNorm<{make_cpp_args(hidden, dtype)}>",
                 rows_bucket=rows, tuning="default" if knobs == _default_knobs(bucket) else
                 "/".join(f"{name}={value}" for name, value in knobs.items()))


# The references: float32 throughout, rounded once to the dtype, as the kernel does. The
# kernel's sum of squares runs in another order: a result may differ by an ulp or two.
def _normalized(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.float()


def _rmsnorm_reference(input: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                       eps: float) -> None:
    out.copy_(_normalized(input, weight, eps))


def _fused_add_rmsnorm_reference(input: torch.Tensor, residual: torch.Tensor,
                                 weight: torch.Tensor, eps: float = 1e-6) -> None:
    residual.add_(input)  # rounded to the residual's dtype, then normalised as stored
    input.copy_(_normalized(residual, weight, eps))


# Two ulps of each dtype (bfloat16 2^-7, float16 2^-10) relative, plus as much absolute for
# results near zero; float32 differs only in the order of the sum.
_TOLERANCE = {torch.bfloat16: Tolerance(2**-6, 2**-6), torch.float16: Tolerance(2**-9, 2**-9),
              torch.float32: Tolerance(1e-5, 1e-5)}


def _check_operands(function: str, input: torch.Tensor, weight: torch.Tensor,
                    **like_input: torch.Tensor) -> None:
    """What the kernel checks of the tensors' shapes and dtypes, for the fake implementations:
    a traced call fails where the kernel would. `like_input` are the tensors shaped and typed
    like input (out, residual)."""
    hidden = input.shape[-1] if input.dim() else None
    for name, tensor in {"weight": weight, **like_input}.items():
        if tensor.dtype != input.dtype:
            raise ArgumentTypeError(f"{function}: '{name}' must have input's dtype "
                                    f"{input.dtype}, got {tensor.dtype}")
        want, what = ((hidden,), "(hidden,)") if name == "weight" else \
            (tuple(input.shape), "input's")
        if tuple(tensor.shape) != want:
            raise ArgumentError(f"{function}: '{name}' must have shape {want} ({what}), got "
                                f"{tuple(tensor.shape)}")


def _rmsnorm_fake(input: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                  eps: float) -> None:
    _check_operands("rmsnorm", input, weight, out=out)


def _fused_add_rmsnorm_fake(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float = 1e-6) -> None:
    _check_operands("fused_add_rmsnorm", input, weight, residual=residual)


@op("jitk::rmsnorm", mutates_args=("out",), reference=_rmsnorm_reference,
    tolerance=_TOLERANCE, cases=lambda: _cases("rmsnorm"), fake=_rmsnorm_fake)
def _rmsnorm(input: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float) -> None:
    _kernel_for(_RMSNORM_SPACE, "rmsnorm", input, eps, out is input)(input, weight, out, eps)


def rmsnorm(input: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
            eps: float = 1e-6) -> torch.Tensor:
    """out = input / sqrt(mean(input^2, -1) + eps) * weight; in place when out is None.
    Returns the tensor written."""
    if out is None:
        out = input
    _rmsnorm(input, weight, out, eps)  # an operator may not return its argument
    return out


@op("jitk::fused_add_rmsnorm", mutates_args=("input", "residual"),
    reference=_fused_add_rmsnorm_reference, tolerance=_TOLERANCE,
    cases=lambda: _cases("fused_add_rmsnorm"), fake=_fused_add_rmsnorm_fake)
def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float = 1e-6) -> None:
    """residual += input; input = rmsnorm(residual) * weight, both in place."""
    _kernel_for(_FUSED_SPACE, "fused_add_rmsnorm", input, eps)(input, residual, weight, eps)


# Tuned out of the box: the choices `python -m jitk tune rmsnorm fused_add_rmsnorm --dtype
# bfloat16 float16 --export-table` found on a GPU, one table a GPU (autotune.table_name),
# used for buckets the user's tuning file lacks. Each holds only choices the space allows.
TABLES = Path(__file__).with_name("tuned")


def _space(entry: str) -> TuningSpace:
    def bucket(input: torch.Tensor, *args: object, **kwargs: object) -> tuple:
        if entry == "fused_add_rmsnorm":
            return _bucket(entry, input)
        out = kwargs["out"] if "out" in kwargs else args[1]  # (weight, out, eps)
        return _bucket(entry, input, out is input)

    def sample(shape: tuple, dtype: torch.dtype, device: torch.device) -> list[tuple]:
        x = torch.randn(*shape, device=device).to(dtype)
        weight = torch.randn(shape[-1], device=device).to(dtype)
        if entry == "rmsnorm":  # both buckets: out of place, and in place
            return [((x, weight, torch.empty_like(x), 1e-6), {}), ((x, weight, x, 1e-6), {})]
        return [((x, torch.randn_like(x), weight, 1e-6), {})]  # eps: the kernel has no default

    def neighbour(args: tuple, kwargs: dict) -> Callable[[], object]:
        input = args[0]
        return gemm_neighbour(input.numel() // max(input.shape[-1], 1), input.dtype,
                              input.device)

    return TuningSpace(_KNOBS, bucket, _default_knobs,
                       lambda bucket, knobs: getattr(_kernels_with(bucket, knobs), entry),
                       allowed=_tried, module_key=_module_key, neighbour=neighbour,
                       beside_knobs=_BESIDE_KNOBS, tables=TABLES,
                       outputs=("out",) if entry == "rmsnorm" else (), sample=sample,
                       shapes=tuple((rows, hidden) for rows in (1, 16, 77, 256, 1024, 4096)
                                    for hidden in (4096, 5120, 7168, 8192, 12288)))


_RMSNORM_SPACE = _space("rmsnorm").attach(_rmsnorm)
_FUSED_SPACE = _space("fused_add_rmsnorm").attach(fused_add_rmsnorm)


# ---------------------------------------------------------------------------- parity cases
# (rows, hidden): one row, odd counts (a block's last turn part empty), an odd hidden size
# (element-wise path), q/k-norm's 128, model widths, and rows read twice (past 1024 threads x
# 16 registers); each as a contiguous tensor, a slice of wider rows, and heads of a QKV buffer.
_SHAPES = ((1, 4096), (77, 5120), (3, 7), (33, 128), (5, 12288), (2, 65536 + 8))


def _layouts(rows: int, hidden: int, dtype: torch.dtype, device: torch.device) -> dict:
    return {
        "contiguous": lambda: torch.randn(rows, hidden, device=device).to(dtype),
        "strided rows": lambda: torch.randn(rows, hidden + 24, device=device).to(dtype)[
            :, 8:8 + hidden],
        "qkv heads": lambda: torch.randn(rows, 3, 2, hidden, device=device).to(dtype)[:, 0],
    }


def _cases(entry: str) -> list:
    from jitk.tools.testing import Case

    cases = []
    for dtype in _SUPPORTED_DTYPES:
        for rows, hidden in _SHAPES:
            for layout in ("contiguous", "strided rows", "qkv heads"):
                def make(device, rows=rows, hidden=hidden, dtype=dtype, layout=layout):
                    x = _layouts(rows, hidden, dtype, device)[layout]()
                    weight = torch.randn(hidden, device=device).to(dtype)
                    if entry == "rmsnorm":
                        return (x, weight, torch.empty_like(x), 1e-6), {}
                    return (x, torch.randn_like(x), weight), {"eps": 1e-5}

                label = f"{str(dtype).removeprefix('torch.')} {rows}x{hidden} {layout}"
                cases.append(Case(label, make, ("out",) if entry == "rmsnorm" else ()))
        if entry == "rmsnorm":  # in place: out is the input
            def in_place(device, dtype=dtype):
                x = torch.randn(9, 4096, device=device).to(dtype)
                return (x, torch.randn(4096, device=device).to(dtype), x, 1e-6), {}
            cases.append(Case(f"{str(dtype).removeprefix('torch.')} 9x4096 in place", in_place,
                              ("out",)))
    return cases


# Common model widths in bfloat16, plus the head dimension that q/k norms use: what
# precompile builds.
COMMON_SIZES = ((128, torch.bfloat16), (4096, torch.bfloat16), (5120, torch.bfloat16),
                (8192, torch.bfloat16), (4096, torch.float16))


def instantiation(function: str, hidden: int, dtype: torch.dtype, rows: int) -> str:
    """The C++ instantiation that jitk.<function> ("rmsnorm", out of place, or
    "fused_add_rmsnorm") runs for `rows` rows: its bucket's choice in the tuning file, else
    the defaults. FlashInfer-Bench Solutions (jitk.fib) are written from it."""
    if function not in ("rmsnorm", "fused_add_rmsnorm"):
        raise ArgumentError(f"instantiation: 'function' must be 'rmsnorm' or "
                            f"'fused_add_rmsnorm', got {function!r}")
    _check_kernel_args(hidden, dtype)
    if not isinstance(rows, int) or rows < 1:
        raise ArgumentError(f"instantiation: 'rows' must be an int >= 1, got {rows!r}")
    bucket = (hidden, dtype, 1 << (rows - 1).bit_length())
    knobs = (_RMSNORM_SPACE if function == "rmsnorm" else _FUSED_SPACE).config(bucket)
    if knobs == _default_knobs(bucket):
        return _norm_type(hidden, dtype)
    return _norm_type(hidden, dtype, _knob_values(knobs))


def precompile_configs() -> list[tuple[str, Callable[[], object]]]:
    """Common model widths in bfloat16 (each module holds both entry points), plus the
    head dimension that q/k norms use; then every choice the tuning file records."""
    defaults = [(f"hidden={hidden} {str(dtype).removeprefix('torch.')}",
                 functools.partial(_kernels, hidden, dtype)) for hidden, dtype in COMMON_SIZES]
    tuned = {}
    for space in (_RMSNORM_SPACE, _FUSED_SPACE):
        for (hidden, dtype, *rest), knobs in space.recorded():  # rest: rows[, "in place"]
            bucket = (hidden, getattr(torch, dtype), *rest)
            label = f"hidden={hidden} {dtype} tuned {'/'.join(map(str, knobs.values()))}"
            tuned[label] = functools.partial(_kernels_with, bucket, knobs)
    return [*defaults, *tuned.items()]
