"""RMSNorm in FlashInfer-Bench's own terms: the Definitions its dataset writes, and jitk's
kernels as Solutions its stock builder compiles.

Its dataset names them `rmsnorm_h<N>`, `(hidden_states, weight) -> output`, and
`fused_add_rmsnorm_h<N>`, `(hidden_states, residual, weight) -> output` (the sum is not an
output; its FlashInfer adapter routes flashinfer.norm.fused_add_rmsnorm to that name), in
bfloat16 with eps 1e-5; batch_size is var, hidden_size const. Another dtype or eps gets the
same form under a longer name (`rmsnorm_h4096_float16_eps1e-06`), so that a dataset name
always means the dataset's op.

A Solution is destination-passing (`run(<inputs>, output)`) and self-contained: main.cu,
rmsnorm.cuh and the files of its folder it includes, beside it, and the jitk headers they
include, under jitk/ in the Solution, so that the Solution folder, which both
FlashInfer-Bench's tvm-ffi builder and jitk's put on the include path, resolves `<jitk/...>`.
Its entry picks, by row count, the instantiation jitk.rmsnorm runs for that row bucket
(jitk.kernels.norm.instantiation); the fused form adds into the output first and normalises
it in place, as jitk's fused kernel normalises the stored sum.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from jitk.base.errors import ArgumentError, ArgumentTypeError
from jitk.build.cpp_args import make_cpp_args
from jitk.build.jit import DEFAULT_CUDA_CFLAGS, KERNEL_DIR
from jitk.integrations.fib_base import AUTHOR, CHECK_WHOLE, require_fib, shipped_files
from jitk.kernels import norm

__all__ = ["DATASET_DTYPE", "DATASET_EPS", "NVCC_APPEND_FLAGS", "definition", "definition_name",
           "signature", "solution"]

DATASET_DTYPE, DATASET_EPS = torch.bfloat16, 1e-5
# What FlashInfer-Bench's tvm-ffi builder (C++17, no flags of a Solution's own) needs for
# jitk's headers, which nvcc reads from the NVCC_APPEND_FLAGS environment variable.
NVCC_APPEND_FLAGS = " ".join(f for f in DEFAULT_CUDA_CFLAGS if f.startswith(("-std", "--expt")))
OPS = ("rmsnorm", "fused_add_rmsnorm")
DEFAULT_HIDDEN = (2048, 4096, 5120, 7168, 8192)  # model widths the benchmark covers
_INPUTS = {"rmsnorm": ("hidden_states", "weight"),
           "fused_add_rmsnorm": ("hidden_states", "residual", "weight")}
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_LARGEST_BUCKET = 1 << 20  # rows past it run the largest bucket's choice
_NAME = re.compile(r"^(rmsnorm|fused_add_rmsnorm)_h(\d+)(?:_(bfloat16|float16|float32))?"
                   r"(?:_eps(\S+))?$")
# eps in a reference: a float literal below one (1e-05, 1e-6, 0.00001).
_CONSTANT = re.compile(r"(?<![\w.])(\d+(?:\.\d*)?e-\d+|0\.\d+)(?![\w.])")

# The dataset's reference form: float32 throughout, one rounding to the dtype at the end.
_REFERENCE = '''\
import torch


@torch.no_grad()
def run({params}):
    x = hidden_states.to(torch.float32){add}
    inv_rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + {eps!r})
    return (x * inv_rms * weight.to(torch.float32)).to(hidden_states.dtype)
'''


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def definition_name(op: str, hidden: int, dtype: torch.dtype = DATASET_DTYPE,
                    eps: float = DATASET_EPS) -> str:
    """`<op>_h<hidden>`, the dataset's name, with `_<dtype>` and `_eps<eps>` where they differ
    from the dataset's."""
    if op not in OPS:
        raise ArgumentError(f"jitk.fib: 'op' must be one of {', '.join(OPS)}, got {op!r}")
    return (f"{op}_h{hidden}" + ("" if dtype == DATASET_DTYPE else f"_{_dtype_name(dtype)}")
            + ("" if eps == DATASET_EPS else f"_eps{eps!r}"))


def definition(op: str, hidden: int, dtype: torch.dtype = DATASET_DTYPE,
               eps: float = DATASET_EPS) -> object:
    """The Definition of `op` ("rmsnorm" or "fused_add_rmsnorm") at a hidden size, dtype and
    eps, in the dataset's form."""
    fib = require_fib()
    if op not in OPS:
        raise ArgumentError(f"jitk.fib: 'op' must be one of {', '.join(OPS)}, got {op!r}")
    if dtype not in _DTYPES.values():
        raise ArgumentTypeError(f"jitk.fib: 'dtype' must be one of {', '.join(_DTYPES)}, "
                                f"got {dtype}")
    if not isinstance(hidden, int) or hidden < 1:
        raise ArgumentError(f"jitk.fib: 'hidden' must be an int >= 1, got {hidden!r}")
    if not isinstance(eps, float) or not eps >= 0.0:
        raise ArgumentError(f"jitk.fib: 'eps' must be a float >= 0, got {eps!r}")
    name = definition_name(op, hidden, dtype, eps)
    rows = {"shape": ["batch_size", "hidden_size"], "dtype": _dtype_name(dtype)}
    inputs = {key: ({"shape": ["hidden_size"], "dtype": _dtype_name(dtype)}
                    if key == "weight" else rows) for key in _INPUTS[op]}
    source = _REFERENCE.format(params=", ".join(_INPUTS[op]), eps=eps,
                               add=" + residual.to(torch.float32)" if "residual" in inputs
                               else "")
    what = "residual + hidden_states, RMS-normalised" if op != "rmsnorm" else "RMSNorm"
    return fib.data.Definition(
        name=name, op_type="rmsnorm", tags=["jitk", f"jitk:{op}"],
        axes={"batch_size": {"type": "var"}, "hidden_size": {"type": "const", "value": hidden}},
        inputs=inputs, outputs={"output": rows}, reference=source,
        description=f"{what} over the last dimension, times weight; eps {eps!r}, float32 "
                    f"inside, rounded to {_dtype_name(dtype)}")


def signature(definition: object) -> tuple[str, int, torch.dtype, float]:
    """(op, hidden, dtype, eps) of a Definition of the dataset's form, checked part by part
    against what jitk's kernels take."""
    parts = _NAME.match(getattr(definition, "name", ""))
    if parts is None:
        raise ArgumentError(f"jitk.fib.solution: 'definition' {getattr(definition, 'name', '')!r}"
                            " is not named <rmsnorm|fused_add_rmsnorm>_h<N>[_<dtype>][_eps<e>]")
    op, hidden = parts[1], int(parts[2])
    if list(definition.inputs) != list(_INPUTS[op]) or list(definition.outputs) != ["output"]:
        raise ArgumentError(
            f"jitk.fib.solution: {definition.name} takes ({', '.join(definition.inputs)}) -> "
            f"{', '.join(definition.outputs)}; jitk's {op} kernel takes "
            f"({', '.join(_INPUTS[op])}) -> output")
    axis = definition.axes.get("hidden_size")
    if getattr(axis, "type", None) != "const" or axis.value != hidden:
        raise ArgumentError(f"jitk.fib.solution: {definition.name}: axis 'hidden_size' must "
                            f"be const {hidden}, got {axis}")
    dtypes = {key: spec.dtype.value if hasattr(spec.dtype, "value") else str(spec.dtype)
              for key, spec in [*definition.inputs.items(), *definition.outputs.items()]}
    if len(set(dtypes.values())) != 1 or (dtype := _DTYPES.get(dtypes["output"])) is None:
        raise ArgumentTypeError(
            f"jitk.fib.solution: {definition.name}: jitk's kernel takes one dtype of "
            f"{', '.join(_DTYPES)} for every tensor, got "
            f"{', '.join(f'{k}: {v}' for k, v in dtypes.items())}")
    eps = float(parts[4]) if parts[4] else DATASET_EPS
    constants = {float(c) for c in _CONSTANT.findall(definition.reference)}
    if constants != {eps}:
        raise ArgumentError(f"jitk.fib.solution: {definition.name}: its reference's eps "
                            f"constants are {sorted(constants) or 'none'}; the name (and so "
                            f"jitk's kernel) says {eps!r}")
    if (parts[3] and dtype != _DTYPES[parts[3]]) or (not parts[3] and dtype != DATASET_DTYPE):
        raise ArgumentTypeError(f"jitk.fib.solution: {definition.name}: the name says "
                                f"{parts[3] or _dtype_name(DATASET_DTYPE)}, the tensors "
                                f"{dtypes['output']}")
    return op, hidden, dtype, eps


# C++ for the fused Solution's main.cu: the sum of two whole contiguous tensors of one shape
# and dtype, each element added in float and rounded to the dtype, as jitk's fused kernel
# stores it in the residual. A thread adds 16 bytes at a time where all three tensors are
# 16-byte aligned and the size divides (two-byte loads would leave the copy well short of
# the memory's bandwidth), else one element.
_ADD_INTO = CHECK_WHOLE + """
template <typename T, int kWidth>
struct alignas(sizeof(T) * kWidth) Lanes {
  T v[kWidth];
};

template <typename T, int kWidth>
__global__ void add_kernel(T* out, const T* x, const T* r, int64_t n) {
  using Pack = Lanes<T, kWidth>;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n / kWidth;
       i += step) {
    Pack a = reinterpret_cast<const Pack*>(x)[i];
    const Pack b = reinterpret_cast<const Pack*>(r)[i];
#pragma unroll
    for (int k = 0; k < kWidth; ++k) {
      a.v[k] = static_cast<T>(static_cast<float>(a.v[k]) + static_cast<float>(b.v[k]));
    }
    reinterpret_cast<Pack*>(out)[i] = a;
  }
}

template <typename T>
T* data_of(const jitk::TensorView& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data_ptr()) + t.byte_offset());
}

template <typename T, int kWidth>
void launch_add(T* out, const T* x, const T* r, int64_t n, cudaStream_t stream) {
  const int64_t threads = 256, packs = n / kWidth;
  const int64_t blocks = (packs + threads - 1) / threads < 8192 ? (packs + threads - 1) / threads
                                                                : 8192;
  add_kernel<T, kWidth><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(out, x, r, n);
}

template <typename T>
void add_into(const jitk::TensorView& out, const jitk::TensorView& x,
              const jitk::TensorView& r) {
  check_whole(out, x);
  check_whole(out, r);
  const int64_t n = out.numel();
  if (n == 0) return;
  constexpr int kWidth = 16 / sizeof(T);
  T* o = data_of<T>(out);
  const T *a = data_of<T>(x), *b = data_of<T>(r);
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const cudaStream_t stream = jitk::current_stream(out.device());
  if (n % kWidth == 0 && aligned(o) && aligned(a) && aligned(b)) {
    launch_add<T, kWidth>(o, a, b, n, stream);
  } else {
    launch_add<T, 1>(o, a, b, n, stream);
  }
  jitk::RuntimeDeviceCheck(cudaGetLastError());
}
"""


def _entry(op: str, hidden: int, dtype: torch.dtype, eps: float) -> str:
    """main.cu: `run` dispatching on the row count to each bucket's instantiation of
    jitk.rmsnorm. The fused form runs it in place on the sum: jitk's fused kernel normalises
    the sum as stored with the same code, so the bits are the same, and the Definition's
    inputs stay as they are without scratch or copies (its kernel works in place)."""
    steps: list[tuple[int, str]] = []
    rows = 1
    while rows <= _LARGEST_BUCKET:
        kernel = norm.instantiation("rmsnorm", hidden, dtype, rows)
        if steps and steps[-1][1] == kernel:
            steps[-1] = (rows, kernel)
        else:
            steps.append((rows, kernel))
        rows *= 2
    source = "hidden_states" if op == "rmsnorm" else "output"
    call = f"::run({source}, weight, output, kEps)"
    branches = "".join(f"  if (rows <= {limit}) return {kernel}{call};\n"
                       for limit, kernel in steps[:-1]) + f"  {steps[-1][1]}{call};\n"
    if op == "rmsnorm":
        body = (f"  const jitk::TensorView hidden_states(hidden_states_), weight(weight_), "
                f"output(output_);\n  const int64_t rows = hidden_states.numel() / {hidden};\n")
        params = "hidden_states_, tvm::ffi::TensorView weight_"
        helpers = ""
    else:
        cpp_type = make_cpp_args(dtype)
        body = f"""\
  const jitk::TensorView hidden_states(hidden_states_), residual(residual_), weight(weight_),
      output(output_);
  add_into<{cpp_type}>(output, hidden_states, residual);
  const int64_t rows = output.numel() / {hidden};
"""
        params = "hidden_states_, tvm::ffi::TensorView residual_, tvm::ffi::TensorView weight_"
        helpers = _ADD_INTO
    return f"""\
// jitk's {op} as a FlashInfer-Bench Solution of {definition_name(op, hidden, dtype, eps)}
// (written by jitk.fib): destination-passing, each row bucket's instantiation as
// jitk.rmsnorm picks it.
#include <jitk/utils.cuh>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>

#include "rmsnorm.cuh"

using jitk::fp16_t, jitk::bf16_t, jitk::fp32_t;

namespace {{
constexpr double kEps = {eps!r};
{helpers}}}  // namespace

void run(tvm::ffi::TensorView {params}, tvm::ffi::TensorView output_) {{
{body}{branches}}}

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, run);
"""


def solution(definition: object, name: str | None = None) -> object:
    """jitk's Solution of a Definition of the dataset's form (definition()), checked against
    the kernel first: its arity and argument names, its tensors' dtype, its hidden size and
    its eps."""
    fib = require_fib()
    if not isinstance(definition, fib.data.Definition):
        raise ArgumentTypeError(f"jitk.fib.solution: 'definition' must be a "
                                f"flashinfer_bench Definition, got {type(definition).__name__}")
    op, hidden, dtype, eps = signature(definition)
    main = _entry(op, hidden, dtype, eps)
    return fib.data.Solution(
        name=name or f"{definition.name}_jitk", definition=definition.name, author=AUTHOR,
        spec=fib.data.BuildSpec(language="cuda", binding="tvm-ffi", target_hardware=["cuda"],
                                entry_point="main.cu::run", destination_passing_style=True),
        sources=shipped_files({"main.cu": main}, KERNEL_DIR / "norm"),
        description=f"jitk's {op} kernel, self-contained; FlashInfer-Bench's tvm-ffi builder "
                    f"builds it with NVCC_APPEND_FLAGS='{NVCC_APPEND_FLAGS}' set")


def sizes(hidden: Iterable[int], dtypes: Iterable[str], eps: Iterable[float]
          ) -> list[tuple[str, int, torch.dtype, float]]:
    """(op, hidden, dtype, eps) for every combination, dtypes by name."""
    unknown = [d for d in dtypes if d not in _DTYPES]
    if unknown:
        raise ArgumentTypeError(f"jitk.fib: dtypes must be among {', '.join(_DTYPES)}, got "
                                f"{', '.join(unknown)}")
    return [(op, h, _DTYPES[d], e) for op in OPS for h in hidden for d in dtypes for e in eps]
