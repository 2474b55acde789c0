"""The Python side of axpy.cuh: a cached loader, and the function users call, which is also
the PyTorch operator torch.ops.example.axpy."""

import functools
from pathlib import Path

import torch

import jitk

KERNEL = Path(__file__).resolve().parent / "axpy.cuh"  # or "axpy.cuh" in jitk/kernels/<family>/


@functools.cache
def _axpy(dtype: torch.dtype):
    args = jitk.make_cpp_args(dtype)
    return jitk.load_jit("axpy", *args, cuda_files=[KERNEL], cuda_compiler="auto",
                         cuda_wrappers=[("axpy", f"axpy::Axpy<{args}>::run")]).axpy


@jitk.op("example::axpy", mutates_args=("y",))
def axpy(alpha: float, x: torch.Tensor, y: torch.Tensor) -> None:
    """y += alpha * x, in place."""
    _axpy(x.dtype)(alpha, x, y)
