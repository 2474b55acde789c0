"""HiCache KV transfers: move KV-cache rows by index lists, between GPU memory and pinned
host memory (either way) or within a GPU, in one kernel on PyTorch's current stream.

    transfer_hicache_one_layer(k_host, v_host, host_slots, k_gpu, v_gpu, gpu_slots)
    # k_host[host_slots[i]] = k_gpu[gpu_slots[i]], and the same for v

Caches are seen as `cache.view(-1, element_dim)`: rows of `element_dim` contiguous elements
(by default every dimension after the first, e.g. heads * head_dim), one row stride apart
(rows may be padded); the source and destination may have different strides and numbers of
rows. A row must be a multiple of 16 bytes, and rows 16-byte aligned: they move as 16-byte
vectors. A cache lives on the GPU of the indices, or in pinned host memory (pageable memory
is refused: a kernel touching it would fault). Indices are int32 or int64 tensors on the
GPU, both lists the same length and dtype; an empty list does nothing.

Indices are never read on the host (that would synchronize): an item whose source or
destination index is negative or at least that cache's number of rows is skipped, its rows
untouched. The all-layer variants take one base address per layer instead of tensors; those
addresses are trusted (they must be 16-byte aligned and valid for every index used), and so
is the upper bound of the indices unless num_tokens_src / num_tokens_dst are given.

`block_quota` caps the blocks of one launch (a block has up to 1024 threads and takes one
SM), so that a transfer can run beside compute kernels; by default the transfer takes the
whole GPU. Calls allocate nothing and never synchronize (CUDA-graph capturable).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from .cpp_args import make_cpp_args
from .custom_op import op
from .jit import load_jit

__all__ = [
    "precompile_configs",
    "transfer_hicache_all_layer",
    "transfer_hicache_all_layer_mla",
    "transfer_hicache_one_layer",
    "transfer_hicache_one_layer_mla",
]

VECTOR_BYTES = 16
# Four 16-byte vectors per thread, read before any is written. The kernel walks a flat list
# of vectors, so the launch shape does not depend on the row size and one default serves
# every element size: 1024 threads x 4 vectors = 64 KiB in flight per SM, more than HBM
# latency needs hidden, and over just two SMs about PCIe's bandwidth-latency product. A
# deeper unroll is built with fewer threads (the buffers live in registers), so the bytes in
# flight stay the same.
DEFAULT_UNROLL = 4
UNROLLS = (1, 2, 4, 8)
_NOT_GIVEN = -1  # what the C++ side reads as "not given" for optional integers


class _Kernels(NamedTuple):
    one_layer: Callable
    one_layer_mla: Callable
    all_layer: Callable
    all_layer_mla: Callable


def _threads_for(unroll: int) -> int:
    """Threads per block: as many as one SM keeps resident with `unroll` vectors each."""
    return min(1024, 4096 // unroll)


@functools.cache
def _kernels(element_size: int, unroll: int) -> _Kernels:
    if element_size <= 0 or element_size % VECTOR_BYTES:
        raise ValueError(f"hicache: a row of {element_size} bytes cannot move as 16-byte "
                         "vectors; the element size must be a positive multiple of 16 bytes")
    if unroll not in UNROLLS:
        raise ValueError(f"hicache: unroll must be one of {UNROLLS}, got {unroll}")
    args = make_cpp_args(element_size, unroll, _threads_for(unroll))
    entry = f"jitk::hicache::HiCache<{args}>"
    module = load_jit("hicache", *args, cuda_files=["hicache.cuh"],
                      cuda_wrappers=[(name, f"{entry}::{name}") for name in _Kernels._fields])
    # Fetched once: a module attribute lookup goes through the FFI each time.
    return _Kernels(*(getattr(module, name) for name in _Kernels._fields))


def _unroll(unroll: int | None) -> int:
    return DEFAULT_UNROLL if unroll is None else unroll


def _optional(value: int | None, name: str, least: int) -> int:
    if value is None:
        return _NOT_GIVEN
    if value < least:
        raise ValueError(f"hicache: {name} must be at least {least}, got {value}")
    return value


def _one_layer_kernels(cache: torch.Tensor, element_dim: int | None,
                       unroll: int | None) -> tuple[_Kernels, int]:
    """The module for rows of `cache` (every dimension after the first unless element_dim is
    given), and the element_dim it was built for."""
    if element_dim is None:
        element_dim = math.prod(cache.shape[1:])
    return _kernels(element_dim * cache.element_size(), _unroll(unroll)), element_dim


@op("jitk::transfer_hicache_one_layer", mutates_args=("k_cache_dst", "v_cache_dst"),
    tags=(torch.Tag.cudagraph_unsafe,))  # a host cache must be the caller's pinned memory
def transfer_hicache_one_layer(
    k_cache_dst: torch.Tensor,
    v_cache_dst: torch.Tensor,
    indices_dst: torch.Tensor,
    k_cache_src: torch.Tensor,
    v_cache_src: torch.Tensor,
    indices_src: torch.Tensor,
    *,
    element_dim: int | None = None,
    unroll: int | None = None,
    block_quota: int | None = None,
) -> None:
    """k_cache_dst[indices_dst[i]] = k_cache_src[indices_src[i]], the same for V."""
    kernels, element_dim = _one_layer_kernels(k_cache_dst, element_dim, unroll)
    kernels.one_layer(
        k_cache_dst, v_cache_dst, indices_dst, k_cache_src, v_cache_src, indices_src,
        element_dim, _optional(block_quota, "block_quota", 1))


@op("jitk::transfer_hicache_one_layer_mla", mutates_args=("cache_dst",),
    tags=(torch.Tag.cudagraph_unsafe,))  # a host cache must be the caller's pinned memory
def transfer_hicache_one_layer_mla(
    cache_dst: torch.Tensor,
    indices_dst: torch.Tensor,
    cache_src: torch.Tensor,
    indices_src: torch.Tensor,
    *,
    element_dim: int | None = None,
    unroll: int | None = None,
    block_quota: int | None = None,
) -> None:
    """cache_dst[indices_dst[i]] = cache_src[indices_src[i]]: one cache (MLA's latent KV)."""
    kernels, element_dim = _one_layer_kernels(cache_dst, element_dim, unroll)
    kernels.one_layer_mla(
        cache_dst, indices_dst, cache_src, indices_src, element_dim,
        _optional(block_quota, "block_quota", 1))


def _all_layer_element_size(element_size: int | None, src_stride: int, dst_stride: int) -> int:
    """By default a row fills its stride, which needs both strides equal."""
    if element_size is not None:
        return element_size
    if src_stride != dst_stride:
        raise ValueError(
            f"hicache: element_size is required when the row strides differ "
            f"(kv_cache_src_stride_bytes={src_stride}, kv_cache_dst_stride_bytes={dst_stride})")
    return src_stride


@op("jitk::transfer_hicache_all_layer", mutates_args=())  # writes through pointers only
def transfer_hicache_all_layer(
    k_ptrs_dst: torch.Tensor,
    v_ptrs_dst: torch.Tensor,
    indices_dst: torch.Tensor,
    k_ptrs_src: torch.Tensor,
    v_ptrs_src: torch.Tensor,
    indices_src: torch.Tensor,
    *,
    kv_cache_src_stride_bytes: int,
    kv_cache_dst_stride_bytes: int,
    element_size: int | None = None,
    unroll: int | None = None,
    block_quota: int | None = None,
    num_tokens_src: int | None = None,
    num_tokens_dst: int | None = None,
) -> None:
    """For every layer l, in one launch: row indices_dst[i] of layer l's K (and V) cache at
    k_ptrs_dst[l] gets row indices_src[i] of the cache at k_ptrs_src[l]. The pointer tables
    are uint64 or int64 GPU tensors, one entry per layer; row r of a layer is at
    `ptr + r * stride_bytes`. `element_size` (bytes per row) defaults to the stride, and is
    required when the two strides differ. With num_tokens_src / num_tokens_dst, indices at or
    past them are skipped too."""
    element_size = _all_layer_element_size(element_size, kv_cache_src_stride_bytes,
                                           kv_cache_dst_stride_bytes)
    _kernels(element_size, _unroll(unroll)).all_layer(
        k_ptrs_dst, v_ptrs_dst, indices_dst, k_ptrs_src, v_ptrs_src, indices_src,
        kv_cache_src_stride_bytes, kv_cache_dst_stride_bytes, element_size,
        _optional(num_tokens_src, "num_tokens_src", 0),
        _optional(num_tokens_dst, "num_tokens_dst", 0),
        _optional(block_quota, "block_quota", 1))


@op("jitk::transfer_hicache_all_layer_mla", mutates_args=())  # writes through pointers only
def transfer_hicache_all_layer_mla(
    ptrs_dst: torch.Tensor,
    indices_dst: torch.Tensor,
    ptrs_src: torch.Tensor,
    indices_src: torch.Tensor,
    *,
    kv_cache_src_stride_bytes: int,
    kv_cache_dst_stride_bytes: int,
    element_size: int | None = None,
    unroll: int | None = None,
    block_quota: int | None = None,
    num_tokens_src: int | None = None,
    num_tokens_dst: int | None = None,
) -> None:
    """transfer_hicache_all_layer for one cache per layer (MLA)."""
    element_size = _all_layer_element_size(element_size, kv_cache_src_stride_bytes,
                                           kv_cache_dst_stride_bytes)
    _kernels(element_size, _unroll(unroll)).all_layer_mla(
        ptrs_dst, indices_dst, ptrs_src, indices_src,
        kv_cache_src_stride_bytes, kv_cache_dst_stride_bytes, element_size,
        _optional(num_tokens_src, "num_tokens_src", 0),
        _optional(num_tokens_dst, "num_tokens_dst", 0),
        _optional(block_quota, "block_quota", 1))


# Bytes per token and layer of common models: 1, 4 or 8 KV heads of 128 fp16/bf16 (what
# one GPU holds under tensor parallelism), and DeepSeek's MLA latent row (576 bf16).
_COMMON_ELEMENT_SIZES = (256, 1024, 2048, 1152)


def precompile_configs() -> list[tuple[str, Callable[[], object]]]:
    """(label, thunk) for the module of each common element size, default unroll."""
    return [(f"element_size={size}", functools.partial(_kernels, size, DEFAULT_UNROLL))
            for size in _COMMON_ELEMENT_SIZES]
