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
from typing import NamedTuple

import torch

from . import api_log
from .cpp_args import make_cpp_args
from .custom_op import Tolerance, op
from .jit import load_jit

__all__ = ["fused_add_rmsnorm", "precompile_configs", "rmsnorm"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HIDDEN = 2**30  # jitk::norm::kMaxHidden (rmsnorm.cuh); a test builds the largest
_FLOAT32_MAX = 3.4028234663852886e38  # eps travels to the kernel as a float32


class _Kernels(NamedTuple):
    rmsnorm: Callable
    fused_add_rmsnorm: Callable


@functools.cache
def _kernels(hidden: int, dtype: torch.dtype) -> _Kernels:
    """The module for one hidden size and dtype; raises before building for ones it lacks."""
    if dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"rmsnorm supports float32, float16 and bfloat16 inputs, got {dtype}")
    if not 1 <= hidden <= _MAX_HIDDEN:
        raise ValueError(f"rmsnorm needs a hidden size (last dimension) of 1 to {_MAX_HIDDEN}, "
                         f"got {hidden}")
    args = make_cpp_args(hidden, dtype)
    norm = f"jitk::norm::RMSNorm<{args}>"
    module = load_jit(
        "rmsnorm", *args,
        cuda_files=["rmsnorm.cuh"],
        cuda_wrappers=[("rmsnorm", f"{norm}::run"),
                       ("fused_add_rmsnorm", f"{norm}::run_fused_add")],
    )
    # Fetched once: a module attribute lookup goes through the FFI each time.
    return _Kernels(module.rmsnorm, module.fused_add_rmsnorm)


# Argument types are checked by the operator layer (jitk.op) before the bodies below run;
# the values the kernel cannot take are refused here, before any module is built. This is
# every eager call's path: one Python call, the checks inline.
def _kernels_for(function: str, input: torch.Tensor, eps: float) -> _Kernels:
    if not 0.0 <= eps <= _FLOAT32_MAX:  # NaN fails both comparisons
        raise ValueError(f"{function}: 'eps' must be finite and >= 0 as a float32 (at most "
                         f"{_FLOAT32_MAX:.7g}), got {eps!r}")
    try:
        hidden = input.shape[-1]
    except IndexError:
        raise ValueError(f"{function}: 'input' is a 0-d tensor; it needs a last dimension "
                         "(the hidden size)") from None
    if api_log.noting:
        api_log.note(kernel=f"jitk::norm::RMSNorm<{make_cpp_args(hidden, input.dtype)}>")
    return _kernels(hidden, input.dtype)


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


@op("jitk::rmsnorm", mutates_args=("out",), reference=_rmsnorm_reference,
    tolerance=_TOLERANCE)
def _rmsnorm(input: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float) -> None:
    _kernels_for("rmsnorm", input, eps).rmsnorm(input, weight, out, eps)


def rmsnorm(input: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
            eps: float = 1e-6) -> torch.Tensor:
    """out = input / sqrt(mean(input^2, -1) + eps) * weight; in place when out is None.
    Returns the tensor written."""
    if out is None:
        out = input
    _rmsnorm(input, weight, out, eps)  # an operator may not return its argument
    return out


@op("jitk::fused_add_rmsnorm", mutates_args=("input", "residual"),
    reference=_fused_add_rmsnorm_reference, tolerance=_TOLERANCE)
def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float = 1e-6) -> None:
    """residual += input; input = rmsnorm(residual) * weight, both in place."""
    _kernels_for("fused_add_rmsnorm", input, eps).fused_add_rmsnorm(input, residual, weight,
                                                                    eps)


# Common model widths in bfloat16, plus the head dimension that q/k norms use: what
# precompile builds and what `python -m jitk fib export` describes.
COMMON_SIZES = ((128, torch.bfloat16), (4096, torch.bfloat16), (5120, torch.bfloat16),
                (8192, torch.bfloat16), (4096, torch.float16))


def precompile_configs() -> list[tuple[str, Callable[[], object]]]:
    """Common model widths in bfloat16 (each module holds both entry points), plus the
    head dimension that q/k norms use."""
    return [(f"hidden={hidden} {str(dtype).removeprefix('torch.')}",
             functools.partial(_kernels, hidden, dtype)) for hidden, dtype in COMMON_SIZES]
