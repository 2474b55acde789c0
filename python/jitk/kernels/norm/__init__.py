"""RMSNorm over the last dimension, and its fused residual form.

    y = rmsnorm(x, weight)                 # in place: x is normalised and returned
    y = rmsnorm(x, weight, out=y)          # into `out`
    fused_add_rmsnorm(x, residual, weight) # residual += x; x = rmsnorm(residual) * weight
    fused_add_rmsnorm(x, residual, weight, float_sum=True)  # FlashInfer's formula

rmsnorm(x) = x / sqrt(mean(x^2) + eps) * weight, accumulated in float32 and rounded to the
input dtype (float32, float16 or bfloat16). `x` may have any leading shape: its leading
dimensions number the rows, and may step through memory with up to two strides, so a slice
of rows, or of a wider last dimension, qualifies, and so do heads cut from a fused QKV
buffer (q/k-norm over `qkv[:, :q_size].view(tokens, heads, head_dim)`, strides
`(qkv_width, head_dim, 1)`). The last dimension must be contiguous. `out` (and `residual`)
need the same number of rows and hidden size, each with strides of its own. `weight` is a
contiguous 1-d tensor of the hidden size and the input's dtype.

fused_add_rmsnorm keeps the sum in the residual's dtype and normalises the sum as stored,
so afterwards `x` equals rmsnorm(residual, weight) exactly: what the unfused
`residual += x; x = rmsnorm(residual)` of a model's code computes. With float_sum=True it
normalises the sum as added in float32, before it is rounded into residual (FlashInfer's
formula; the two differ by an ulp here and there in 16-bit dtypes, where the sum rounds).
Either way a row's bits do not depend on the other rows of the call.

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

from jitk.base.errors import ArgumentError, ArgumentTypeError
from jitk.build.cpp_args import make_cpp_args
from jitk.build.jit import load_jit
from jitk.kernels.norm import tuning
from jitk.kernels.norm.cases import parity_cases
from jitk.kernels.norm.rules import check_applies as _check_applies
from jitk.kernels.norm.rules import default_knobs
from jitk.runtime.op import Tolerance, op
from jitk.tools import api_log
from jitk.tools.autotune import TuningSpace
from jitk.tools.timing import gemm_neighbour

# Beside the ops, what tools, benchmarks and tests build, time and compare: each module's kernels
# (the default's, the tuner's candidates, a choice's, any tunings'), the tuning spaces and the
# default knobs of a bucket.
__all__ = ["FUSED_SPACE", "MAX_HIDDEN", "RMSNORM_SPACE", "candidate_kernels", "chosen_kernels",
           "default_kernels", "default_knobs", "fused_add_rmsnorm", "instantiation",
           "kernels_with", "load_kernels", "module_key", "precompile_configs", "rmsnorm",
           "tuning_choices"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HIDDEN = 2**30  # jitk::norm::kMaxHidden (rmsnorm_tiling.cuh); a test builds the largest
_FLOAT32_MAX = 3.4028234663852886e38  # eps travels to the kernel as a float32


class _Kernels(NamedTuple):
    rmsnorm: Callable
    fused_add_rmsnorm: Callable
    # (module name, hidden, dtype, tunings, index): where fused_add_rmsnorm_float_sum is built
    twin: tuple

    def fused_add_rmsnorm_float_sum(self) -> Callable:
        """The fused form at float_sum=True of the same tuning, from a module of its own
        (built at the first request), so that the common modules build none of its kernels."""
        name, hidden, dtype, tunings, index = self.twin
        return _float_sum_entries(name, hidden, dtype, tunings)[index]


def _check_kernel_args(hidden: int, dtype: torch.dtype) -> None:
    if dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"rmsnorm supports float32, float16 and bfloat16 inputs, got {dtype}")
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"rmsnorm needs a hidden size (last dimension) of 1 to {MAX_HIDDEN}, "
                         f"got {hidden}")


# The modules a call uses: a width's defaults, and one tuned choice (_chosen_module).
_DEFAULT_MODULE, _TUNED_MODULE = "rmsnorm", "rmsnorm_tuned"

# The host compiler builds a module's entry points in up to this many units side by side
# (load_jit's host_units): rmsnorm's apart from the fused form's, and the tuner's candidates
# spread wider. rmsnorm.cuh holds only inline and template definitions, as that asks.
_HOST_UNITS = 8


def _entries(name: str, hidden: int, dtype: torch.dtype, tunings: tuple,
             methods: dict[str, str]) -> list[dict[str, Callable]]:
    """One module of each entry point (name -> RMSNorm's static method) at each tuning (knob
    values in tuning.KNOBS's order), or at rmsnorm_tiling.cuh's DefaultTuning when none is
    given; per tuning, entry name -> function."""
    _check_kernel_args(hidden, dtype)
    args = make_cpp_args(hidden, dtype)
    norms = [_norm_type(hidden, dtype, t) for t in tunings] or [_norm_type(hidden, dtype)]
    suffixes = [f"_{i}" for i in range(len(tunings))] if len(tunings) > 1 else [""]
    module = load_jit(
        name, *args, *(make_cpp_args(*tunings[0]) if len(tunings) == 1 else ()),
        cuda_files=["rmsnorm.cuh"], cuda_compiler="auto",
        cuda_wrappers=[(f"{entry}{suffix}", f"{norm}::{method}")
                       for norm, suffix in zip(norms, suffixes)
                       for entry, method in methods.items()],
        host_units=_HOST_UNITS)
    # Fetched once: a module attribute lookup goes through the FFI each time.
    return [{entry: getattr(module, f"{entry}{suffix}") for entry in methods}
            for suffix in suffixes]


def load_kernels(name: str, hidden: int, dtype: torch.dtype, *tunings: tuple) -> list[_Kernels]:
    """One module of both entry points at each tuning (see _entries)."""
    found = _entries(name, hidden, dtype, tunings,
                     {"rmsnorm": "run", "fused_add_rmsnorm": "run_fused_add"})
    return [_Kernels(**entries, twin=(name, hidden, dtype, tunings, i))
            for i, entries in enumerate(found)]


@functools.cache
def _float_sum_entries(name: str, hidden: int, dtype: torch.dtype,
                       tunings: tuple) -> list[Callable]:
    """The float_sum fused form of each tuning of module `name`, in a module of its own."""
    return [entries["fused_add_rmsnorm"] for entries in _entries(
        f"{name}_float_sum", hidden, dtype, tunings,
        {"fused_add_rmsnorm": "run_fused_add_float_sum"})]


def _norm_type(hidden: int, dtype: torch.dtype, tuning: tuple | None = None) -> str:
    """The C++ instantiation at a tuning (knob values in tuning.KNOBS's order), else the
    default's; its dtype is written unqualified (bf16_t), as load_jit's sources declare it."""
    args = make_cpp_args(hidden, dtype)
    if tuning is None:
        return f"jitk::norm::RMSNorm<{args}>"
    return f"jitk::norm::RMSNorm<{args}, jitk::norm::Tuning<{make_cpp_args(*tuning)}>>"


@functools.cache
def _one_choice(name: str, hidden: int, dtype: torch.dtype, tunings: tuple) -> _Kernels:
    """A module of one tuning (or of the defaults, `tunings` empty), loaded once a process."""
    return load_kernels(name, hidden, dtype, *tunings)[0]


def default_kernels(hidden: int, dtype: torch.dtype) -> _Kernels:
    """The module for one hidden size and dtype with the default launch knobs (rmsnorm.cuh's
    DefaultTuning); raises before building for ones it lacks."""
    return _one_choice(_DEFAULT_MODULE, hidden, dtype, ())


def tuning_choices(hidden: int, dtype: torch.dtype) -> list[tuple[dict, Callable[[], _Kernels]]]:
    """The default's knobs, then every other choice the tuner may pick at some row count of
    a width and dtype, each with a function that builds (or loads) its entry points
    (rmsnorm(input, weight, out, eps), fused_add_rmsnorm(input, residual, weight, eps)): what
    `python -m jitk check --invariance` holds to the default's bits."""
    _check_kernel_args(hidden, dtype)
    choices = (default_knobs((hidden, dtype)),
               *tuning.candidates(hidden, dtype, True, tuning.unstable_allowed()))
    return [(knobs, functools.partial(kernels_with, (hidden, dtype), knobs)) for knobs in choices]


# The candidates of a width and dtype share one module (those without PDL, tried only beside a
# GEMM, another): building them one module each took an H100 host's 16 cores 50 s for the
# benchmark's 10 widths and dtypes, most of it the front end that each build repeats. A choice
# outside them (a file from another jitk) gets its own.
@functools.cache
def candidate_kernels(hidden: int, dtype: torch.dtype, pdl: bool = True,
                      unstable: bool = False) -> list[_Kernels]:
    name = "rmsnorm_candidates" + ("_unstable" if unstable else "") + ("" if pdl else "_no_pdl")
    return load_kernels(name, hidden, dtype,
                        *(tuning.knob_values(knobs)
                          for knobs in tuning.candidates(hidden, dtype, pdl, unstable)))


def _candidate_index(bucket: tuple, knobs: dict) -> int | None:
    """The place of `knobs` in its candidates module (with PDL or without), if it has one."""
    candidates = tuning.candidates(*bucket[:2], knobs["pdl"], tuning.unstable_allowed())
    return candidates.index(knobs) if knobs in candidates else None


def kernels_with(bucket: tuple, knobs: dict) -> _Kernels:
    """What tuning builds for a choice: a candidate's from the candidates' shared module,
    any other as a call would (chosen_kernels)."""
    _check_applies(bucket, knobs)
    index = None if knobs == default_knobs(bucket) else _candidate_index(bucket, knobs)
    if index is None:
        return chosen_kernels(bucket, knobs)
    hidden, dtype = bucket[:2]
    return candidate_kernels(hidden, dtype, knobs["pdl"], tuning.unstable_allowed())[index]


def _chosen_module(bucket: tuple, knobs: dict) -> tuple:
    """Which module a call uses for a choice, as (name, hidden, dtype, tunings): the width's
    defaults (no tunings), else a module of that one choice."""
    if knobs == default_knobs(bucket):
        return (_DEFAULT_MODULE, *bucket[:2], ())
    return (_TUNED_MODULE, *bucket[:2], (tuning.knob_values(knobs),))


def chosen_kernels(bucket: tuple, knobs: dict) -> _Kernels:
    """What a call runs for the choice a lookup made (_chosen_module). Not the tuner's
    candidates module, which holds every candidate of the width and takes several times as
    long to build; the kernel is the same instantiation in either, so are its bits."""
    _check_applies(bucket, knobs)
    return _one_choice(*_chosen_module(bucket, knobs))


def _chosen_float_sum(bucket: tuple, knobs: dict) -> Callable:
    """The float_sum form of chosen_kernels' fused entry (its twin), built without building
    that module too."""
    _check_applies(bucket, knobs)
    return _float_sum_entries(*_chosen_module(bucket, knobs))[0]


def module_key(bucket: tuple, knobs: dict) -> tuple:
    """What kernels_with builds: a module a hidden size and dtype for the default, one for
    the tuner's candidates with PDL and one for those without, one for any other choice;
    each holds both entry points."""
    hidden, dtype = bucket[:2]
    if knobs == default_knobs(bucket):
        return ("jitk.kernels.norm", hidden, dtype, "default")
    if _candidate_index(bucket, knobs) is not None:
        return ("jitk.kernels.norm", hidden, dtype, "candidates" if knobs["pdl"] else
                "candidates without PDL", tuning.unstable_allowed())
    return ("jitk.kernels.norm", hidden, dtype, *tuning.knob_values(knobs))


def _rows_bucket(input: torch.Tensor, hidden: int) -> int:
    """The row count rounded up to a power of two: tuned choices are kept per bucket."""
    return 1 << (input.numel() // hidden - 1).bit_length() if hidden else 1


# Argument types are checked by the operator layer (jitk.op) before the bodies below run;
# the values the kernel cannot take are refused here, before any module is built. This is
# every eager call's path: one Python call, the eps check, one dict lookup by exact shape and
# placement (the tuning space's call cache) and the call log's flag; the shape bucket is
# worked out only for a new shape or a logged call.
def _kernel_for(space: TuningSpace, function: str, input: torch.Tensor, eps: float,
                in_place: bool = False, float_sum: bool = False) -> Callable:
    if not 0.0 <= eps <= _FLOAT32_MAX:  # NaN fails both comparisons
        raise ValueError(f"{function}: 'eps' must be finite and >= 0 as a float32 (at most "
                         f"{_FLOAT32_MAX:.7g}), got {eps!r}")
    kernel = space.calls.get((input.shape, input.dtype, in_place, float_sum))
    if kernel is None:
        bucket = _bucket(function, input, in_place)
        # float_sum runs the bucket's choice of the stored-sum form: the same layouts, which
        # keep the same order of the sum (the tuner times the stored-sum form only).
        kernel = space.calls[input.shape, input.dtype, in_place, float_sum] = (
            _chosen_float_sum(bucket, space.config(bucket)) if float_sum else
            space.lookup(bucket))
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
    space = RMSNORM_SPACE if function == "rmsnorm" else FUSED_SPACE
    knobs = space.config(bucket)
    api_log.note(kernel=f"jitk::norm::RMSNorm<{make_cpp_args(hidden, dtype)}>",
                 rows_bucket=rows, tuning="default" if knobs == default_knobs(bucket) else
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
                                 weight: torch.Tensor, eps: float = 1e-6, *,
                                 float_sum: bool = False) -> None:
    added = input.float() + residual.float()
    residual.copy_(added)  # rounded to the residual's dtype: normalised so unless float_sum
    input.copy_(_normalized(added if float_sum else residual, weight, eps))


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
                            eps: float = 1e-6, *, float_sum: bool = False) -> None:
    _check_operands("fused_add_rmsnorm", input, weight, residual=residual)


@op("jitk::rmsnorm", mutates_args=("out",), reference=_rmsnorm_reference,
    tolerance=_TOLERANCE, cases=lambda: parity_cases("rmsnorm", _SUPPORTED_DTYPES),
    fake=_rmsnorm_fake)
def _rmsnorm(input: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float) -> None:
    _kernel_for(RMSNORM_SPACE, "rmsnorm", input, eps, out is input)(input, weight, out, eps)


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
    cases=lambda: parity_cases("fused_add_rmsnorm", _SUPPORTED_DTYPES),
    fake=_fused_add_rmsnorm_fake)
def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float = 1e-6, *, float_sum: bool = False) -> None:
    """residual += input; input = rmsnorm(residual) * weight, both in place. float_sum=True
    normalises the sum as added in float32 rather than as stored (FlashInfer's formula)."""
    _kernel_for(FUSED_SPACE, "fused_add_rmsnorm", input, eps, False, float_sum)(
        input, residual, weight, eps)  # positional: a call's path


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

    return TuningSpace(tuning.KNOBS, bucket, default_knobs,
                       lambda bucket, knobs: getattr(kernels_with(bucket, knobs), entry),
                       use=lambda bucket, knobs: getattr(chosen_kernels(bucket, knobs), entry),
                       allowed=tuning.tried, module_key=module_key, neighbour=neighbour,
                       beside_knobs=tuning.BESIDE_KNOBS, tables=TABLES,
                       outputs=("out",) if entry == "rmsnorm" else (), sample=sample,
                       shapes=tuple((rows, hidden) for rows in (1, 16, 77, 256, 1024, 4096)
                                    for hidden in (4096, 5120, 7168, 8192, 12288)))


RMSNORM_SPACE = _space("rmsnorm").attach(_rmsnorm)
FUSED_SPACE = _space("fused_add_rmsnorm").attach(fused_add_rmsnorm)


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
    knobs = (RMSNORM_SPACE if function == "rmsnorm" else FUSED_SPACE).config(bucket)
    if knobs == default_knobs(bucket):
        return _norm_type(hidden, dtype)
    return _norm_type(hidden, dtype, tuning.knob_values(knobs))


def precompile_configs() -> list[tuple[str, Callable[[], object]]]:
    """Common model widths in bfloat16 (each module holds both entry points), plus the
    head dimension that q/k norms use; then the module a call uses for each choice the
    tuning file (or the shipped table) records, once: one choice often serves many row
    counts, and a configuration that only waits for another's build holds a worker."""
    defaults = [(f"hidden={hidden} {str(dtype).removeprefix('torch.')}",
                 functools.partial(default_kernels, hidden, dtype))
                for hidden, dtype in COMMON_SIZES]
    modules = {(_DEFAULT_MODULE, hidden, dtype, ()) for hidden, dtype in COMMON_SIZES}
    tuned = {}
    for space in (RMSNORM_SPACE, FUSED_SPACE):
        for (hidden, dtype, *rest), knobs in space.recorded():  # rest: rows[, "in place"]
            bucket = (hidden, getattr(torch, dtype), *rest)
            if (module := _chosen_module(bucket, knobs)) not in modules:
                modules.add(module)
                label = f"hidden={hidden} {dtype} tuned {'/'.join(map(str, knobs.values()))}"
                tuned[label] = functools.partial(chosen_kernels, bucket, knobs)
    return [*defaults, *tuned.items()]
