"""HiCache KV transfers: move KV-cache rows by index lists, between GPU memory and pinned
host memory (either way) or within a GPU, on PyTorch's current stream. The calls are
SGLang 0.5.23's, names, forms and defaults (README.md lists what still differs):

    transfer_hicache_one_layer(k_host, v_host, host_slots, k_gpu, v_gpu, gpu_slots)
    # k_host[host_slots[i]] = k_gpu[gpu_slots[i]], and the same for v

Rows and pages. A cache is seen as rows ("slots") of `element_dim` contiguous elements, in
the order of `cache.view(-1, element_dim)`; the slots may sit under one stride (a flat cache,
rows possibly padded) or two (a paged cache: pages of slots, e.g. the [page, page_size, ...]
layer view of SGLang's page_first_direct host layout). `element_dim` defaults to the last
dimension, as in SGLang (SGLang's pools pass it). Every index names one slot, whatever
`page_size` says: as in SGLang, `page_size` is a hint (here: the run of consecutive slots
"auto" may expect), never a change to which rows move. jitk's pages are asked for by name:
with `index_granularity="page"` the lists come in runs of `page_size` consecutive slots and
only the first index of each run is read (their length must be a multiple of `page_size`,
and a page may not straddle two pages of a paged cache). Rows must be a multiple of 16 bytes
and 16-byte aligned. A cache lives on the GPU or in pinned host memory (pageable memory is
refused).

Methods (`method=`), every one selectable:
- "kernel": a transfer kernel on `block_quota` SMs (by default 6 when the transfer crosses
  PCIe, the fewest that reach the link's bandwidth, so compute keeps the rest; where a call
  names neither `unroll` nor `block_quota`, `python -m jitk tune` may have chosen both for
  its rows' size, direction and count). It reads the
  indices on the GPU, or pinned on the host, at run time (so graph replays see new values),
  and skips a page whose run is out of range. Beside a kernel that fills every SM (a large
  GEMM) its blocks wait for SMs, and its bandwidth drops with them.
- "copy_engine": the GPU's copy engines, one batched submission per call (on the legacy
  default stream, which the batch calls refuse, on a stream of jitk's that waits for it and
  that it waits for); no SM is used, so the bandwidth holds beside compute. A call whose
  destination rows overlap its source rows is refused (no order of its copies is defined).
  All-layer copies join the current stream of the GPU their pointer tables point into. The
  indices (and all-layer pointer tables) must be CPU tensors: the call reads them on the
  host and refuses an index it cannot move. Under CUDA graph capture the copies are
  recorded one node each with the addresses of that moment: replays repeat those pages, well
  below the eager bandwidth. `unroll` and `block_quota` do not apply.
- "auto" (default): the method that moves the given tensors fastest on their own (the kernel
  near a pinned copy_'s bandwidth at any page size; the copy engines, whose copies each cost
  fixed host and engine time, far below it for small copies and at a pinned copy's bandwidth
  from COPY_ENGINE_MIN_COPY_BYTES on; figures in docs/developer_guide/
  debugging_and_performance.md), never one below half of the best (see _auto). Indices on the
  GPU: the kernel. Indices on the host: the copy engines where one copy moves
  COPY_ENGINE_MIN_COPY_BYTES or more (a run of page_size packed rows, SGLang's pages, where the
  lists' first page is such a run; else one row), else the kernel on a copy of the indices made
  on the GPU during the call. So under "auto" host indices, pinned or not, are always read
  during the call; only method="kernel" reads pinned ones in place, in stream order. Where the
  kernel cannot run (no GPU tensor to place it, or all-layer pointer tables on the host) the
  copy engines do.

The all-layer variants take one base address per layer (uint64/int64 pointer tables)
instead of tensors; those addresses are trusted (16-byte aligned, valid for every index
used), and so is the upper bound of the indices unless num_tokens_src / num_tokens_dst are
given. Calls allocate no GPU memory (the copy engines' host-side lists grow once per
thread and are reused), except "auto"'s GPU copies of host indices (PyTorch's caching
allocator), and never synchronize.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from jitk.build.cpp_args import make_cpp_args
from jitk.build.jit import load_jit
from jitk.kernels.hicache.reference import (
    all_layer_cases,
    all_layer_mla_reference,
    all_layer_reference,
    checked_int,
    make_cache,
    one_layer_cases,
    one_layer_mla_reference,
    one_layer_reference,
    resolved_element_dim,
    slots_per_index,
    staged_cases,
    staged_mla_reference,
    staged_reference,
)
from jitk.runtime.op import Tolerance, op
from jitk.runtime.streams import current_stream
from jitk.tools import api_log
from jitk.tools.autotune import TuningSpace

__all__ = [
    "can_use_hicache_jit_kernel",
    "can_use_write_back_jit_kernel",
    "precompile_configs",
    "transfer_hicache_all_layer",
    "transfer_hicache_all_layer_mla",
    "transfer_hicache_all_layer_mla_staged_lf_pf",
    "transfer_hicache_all_layer_staged_lf_pf",
    "transfer_hicache_one_layer",
    "transfer_hicache_one_layer_mla",
]

METHODS = ("auto", "kernel", "copy_engine")
# What one index names: a slot (SGLang's meaning, whatever page_size is) or a page of
# page_size slots (jitk's page entry, asked for by name).
INDEX_GRANULARITIES = ("token", "page")
# Python's copy of the rules the C++ side (hicache_layout.cuh) holds for the template
# arguments, applied before any build; tests/test_hicache.py pins the pair.
VECTOR_BYTES = 16
MAX_ELEMENT_BYTES = 1 << 20
UNROLLS = (1, 2, 4, 8)
_EXACT = Tolerance(0.0, 0.0)  # a transfer moves bytes
# Four 16-byte vectors per thread, read before any is written: 1024 threads x 4 vectors = 64
# KiB in flight per SM, more than HBM latency needs hidden, and over a few SMs about PCIe's
# bandwidth-latency product. A deeper unroll is built with fewer threads.
DEFAULT_UNROLL = 4
# "auto" with host indices: the copy engines from copies of this many bytes on, the smallest
# copy measured to reach a pinned copy_'s bandwidth (a smaller one trails the kernel).
COPY_ENGINE_MIN_COPY_BYTES = 64 << 10
# "auto"'s third choice: the kernel, on indices copied to its GPU during the call.
KERNEL_ON_COPIED_INDICES = "kernel on GPU copies of the indices"

_NOT_GIVEN = -1  # what the C++ side reads as "not given" for optional integers
# Each module's files, every header it includes among them, so that an edit of any changes the
# module's cache key (load_jit hashes the files it is given).
_KERNEL_FILES = ("hicache_layout.cuh", "hicache.cuh")
_COPY_FILES = ("hicache_layout.cuh", "hicache_copy_list.cuh", "hicache_copy.cuh")
_STAGED_FILES = (*_COPY_FILES, "hicache_staged.cuh")
_MODULE_FILES = (_KERNEL_FILES, _COPY_FILES, _STAGED_FILES)
_ENTRY_POINTS = ("one_layer", "one_layer_mla", "all_layer", "all_layer_mla")


class _Entries(NamedTuple):
    one_layer: Callable
    one_layer_mla: Callable
    all_layer: Callable
    all_layer_mla: Callable


@functools.cache
def _kernel_module(element_size: int, unroll: int) -> _Entries:
    """The kernel for rows of element_size bytes; both checked by the caller."""
    args = make_cpp_args(element_size, unroll)
    entry = f"jitk::hicache::HiCache<{args}>"
    module = load_jit("hicache", *args, cuda_files=list(_KERNEL_FILES),
                      cuda_wrappers=[(name, f"{entry}::{name}") for name in _ENTRY_POINTS])
    # Fetched once: a module attribute lookup goes through the FFI each time.
    return _Entries(*(getattr(module, name) for name in _ENTRY_POINTS))


@functools.cache
def _copy_module():
    """The copy-engine entry points: one module for every element size."""
    names = (*_ENTRY_POINTS, "vector_bytes", "element_size_supported", "unroll_supported",
             "pointer_device")
    return load_jit("hicache_copy", cuda_files=list(_COPY_FILES),
                    cuda_wrappers=[(name, f"jitk::hicache::CopyEngine::{name}")
                                   for name in names])


@functools.cache
def _staged_module():
    """The staged write-back (a gather kernel and the copy engines): every element size."""
    return load_jit("hicache_staged", cuda_files=list(_STAGED_FILES),
                    cuda_wrappers=[(name, f"jitk::hicache::StagedWriteBack::{name}")
                                   for name in ("lf_pf", "lf_pf_mla")])


@functools.cache
def _copy_entries() -> _Entries:
    module = _copy_module()
    return _Entries(*(getattr(module, name) for name in _ENTRY_POINTS))


# ------------------------------------------------------------------------- argument checks
# Types are the operator layer's to check (jitk.op, from the annotations); values are here
# and in jitk.kernels.hicache.reference (what the references read too).
def _optional(value: int | None, name: str, least: int) -> int:
    return _NOT_GIVEN if value is None else checked_int(value, name, least)


def _element_size(size: int, source: str) -> int:
    """A row size a module can be built for; `source` says where it came from."""
    if size <= 0 or size % VECTOR_BYTES:
        raise ValueError(f"hicache: a row of {size} bytes ({source}) cannot move as 16-byte "
                         "vectors; the element size must be a positive multiple of 16 bytes")
    if size > MAX_ELEMENT_BYTES:
        raise ValueError(f"hicache: a row of {size} bytes ({source}) is over the "
                         f"{MAX_ELEMENT_BYTES} bytes a module is built for")
    return size


def _unroll(unroll: object) -> int:
    if unroll is None:
        return DEFAULT_UNROLL
    value = checked_int(unroll, "unroll", 1)
    if value not in UNROLLS:
        raise ValueError(f"hicache: unroll must be one of {UNROLLS}, got {value}")
    return value


def _pages(page_size: object, index_granularity: object) -> tuple[int, int]:
    """(the page_size hint, the slots one index names) after checking both."""
    hint = checked_int(1 if page_size is None else page_size, "page_size", 1)
    if index_granularity not in INDEX_GRANULARITIES:
        raise ValueError(f"hicache: index_granularity must be one of {INDEX_GRANULARITIES}, "
                         f"got {index_granularity!r}")
    return hint, slots_per_index(hint, index_granularity)


def _method(method: object, indices: torch.Tensor, copy_bytes: Callable[[], int],
            kernel_gpu: int | None) -> str:
    """The method to run: `method` itself, or "auto"'s choice. `copy_bytes()` is what one
    copy-engine copy would move, asked only where the choice needs it; `kernel_gpu` the GPU
    the kernel would run on, None where it cannot run."""
    if method not in METHODS:
        raise ValueError(f"hicache: method must be one of {METHODS}, got {method!r}")
    if method != "auto":
        return method
    if indices.is_cuda:
        return "kernel"
    return _auto(copy_bytes(), kernel_gpu is not None)


def _auto(copy_bytes: int, kernel_runs: bool) -> str:
    """"auto" for host indices: the copy engines where their copies are large enough to
    reach the link's bandwidth, else the kernel (on GPU copies of the indices) if it can
    run; tests/test_hicache.py holds the decision table."""
    if copy_bytes >= COPY_ENGINE_MIN_COPY_BYTES or not kernel_runs:
        return "copy_engine"
    return KERNEL_ON_COPIED_INDICES


def _run(indices_dst: torch.Tensor, indices_src: torch.Tensor, hint: int) -> int:
    """The run of consecutive slots "auto" expects of host indices: the page_size hint where
    the first page of both lists is such a run (SGLang's pages), else 1 (token indices, as
    HiSparse passes them with page_size=64). Only the first page is read: a hint the rest of
    the lists break still misleads "auto"."""
    if hint == 1 or indices_dst.numel() < hint:
        return 1
    for indices in (indices_dst, indices_src):
        first = indices[:hint]
        if not torch.equal(first - first[0], torch.arange(hint, dtype=indices.dtype)):
            return 1
    return hint


def _on_gpu(tensors: tuple, positions: tuple[int, int], gpu: int) -> tuple:
    """`tensors` with the index lists at `positions` replaced by copies on `gpu`, read now:
    from pageable memory the copy returns once the host has read the source; a pinned one
    is first copied to pageable memory, so that it is read now too, not in stream order."""
    moved = list(tensors)
    for at in positions:
        indices = moved[at]
        if indices.is_pinned():
            indices = torch.empty_like(indices, pin_memory=False).copy_(indices)
        moved[at] = indices.to(f"cuda:{gpu}", non_blocking=True)
    return tuple(moved)


def _gpu_of(*tensors: torch.Tensor) -> int | None:
    """The GPU of the first tensor on one, or None."""
    return next((t.device.index for t in tensors if t.is_cuda), None)


def _packed(cache: torch.Tensor, element_dim: int) -> bool:
    """Whether the slots of a page sit back to back in `cache`, so that a copy engine moves
    a page in one copy rather than a row at a time (the C++ side checks the layout)."""
    covered = 1
    for size, stride in zip(reversed(cache.shape), reversed(cache.stride())):
        if covered % element_dim == 0 and size > 1:  # the first dimension past a row
            return covered > element_dim or stride == element_dim
        covered *= size
    return True


def _tables_gpu(tensors: tuple, caches: int) -> int | None:
    """The GPU the first layer of the copy engines' pointer tables (host tensors) points
    into, source first; None (the current GPU) where neither points into a GPU's memory."""
    for table in (tensors[caches + 1], tensors[0]):
        if table.numel() > 0 and not table.is_cuda:
            device = _copy_module().pointer_device(int(table[0]))
            if device >= 0:
                return device
    return None


def _stream(*tensors: torch.Tensor) -> int:
    """The handle of PyTorch's current stream on the GPU of the first GPU tensor (the
    current GPU if none): the copy engines' calls may have no GPU tensor to tell. Without a
    GPU it is 0, and the C++ checks refuse the call first."""
    devices = [t.device.index for t in tensors if t.is_cuda]
    return current_stream(devices[0] if devices else None)[1]


def _instantiation(method: str, element_size: int, unroll: int, quota: int) -> dict:
    """What a call's log notes about the code it runs (JITK_LOGLEVEL=3)."""
    if method != "kernel":
        return {"module": "hicache_copy"}
    return {"kernel": f"jitk::hicache::HiCache<{element_size}, {unroll}>",
            "block_quota": "default" if quota == _NOT_GIVEN else quota}


# ---------------------------------------------------------------------------- one layer
@op("jitk::transfer_hicache_one_layer", mutates_args=("k_cache_dst", "v_cache_dst"),
    reference=one_layer_reference, tolerance=_EXACT, cases=lambda: one_layer_cases(False),
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
    page_size: int | None = None,
    method: str = "auto",
    index_granularity: str = "token",
) -> None:
    """k_cache_dst[indices_dst[i]] = k_cache_src[indices_src[i]], the same for V."""
    _one_layer(2, (k_cache_dst, v_cache_dst, indices_dst, k_cache_src, v_cache_src,
                   indices_src), element_dim, unroll, block_quota, page_size, method,
               index_granularity)


@op("jitk::transfer_hicache_one_layer_mla", mutates_args=("cache_dst",),
    reference=one_layer_mla_reference, tolerance=_EXACT,
    cases=lambda: one_layer_cases(True),
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
    page_size: int | None = None,
    method: str = "auto",
    index_granularity: str = "token",
) -> None:
    """cache_dst[indices_dst[i]] = cache_src[indices_src[i]]: one cache (MLA's latent KV)."""
    _one_layer(1, (cache_dst, indices_dst, cache_src, indices_src), element_dim, unroll,
               block_quota, page_size, method, index_granularity)


def _one_layer(caches: int, tensors: tuple, element_dim: object, unroll: object,
               block_quota: object, page_size: object, method: object,
               index_granularity: object) -> None:
    """The one-layer call, K/V (caches=2) or MLA: `tensors` in the entry point's order."""
    dst, indices_dst, src = tensors[0], tensors[caches], tensors[caches + 1]
    element_dim = resolved_element_dim(dst, element_dim)
    element_size = _element_size(element_dim * dst.element_size(),
                                 f"element_dim {element_dim} of {dst.dtype}")
    hint, pages = _pages(page_size, index_granularity)
    launch_named = unroll is not None or block_quota is not None
    unroll, quota = _unroll(unroll), _optional(block_quota, "block_quota", 1)
    gpu = _gpu_of(dst, src)
    chosen = _method(method, indices_dst, lambda: element_size * (
        _run(tensors[caches], tensors[2 * caches + 1], hint)
        if _packed(dst, element_dim) and _packed(src, element_dim) else 1), gpu)
    if chosen == KERNEL_ON_COPIED_INDICES:
        tensors, chosen = _on_gpu(tensors, (caches, 2 * caches + 1), gpu), "kernel"
    if chosen == "kernel" and not launch_named:  # the tuned launch, or today's default
        launch = _LAUNCH_SPACES[caches].lookup(
            _launch_bucket(dst, src, indices_dst, element_size, pages))
        if not isinstance(launch, _Launch):  # JITK_AUTOTUNE=1: tunes this bucket, then runs
            return launch(*tensors, element_dim=element_dim, page_size=page_size,
                          index_granularity=index_granularity)
        unroll, quota = launch.unroll, _optional(launch.block_quota, "block_quota", 1)
    if api_log.noting:
        api_log.note(method=chosen, **_instantiation(chosen, element_size, unroll, quota))
    if chosen == "kernel":
        entries = _kernel_module(element_size, unroll)
        entry = entries.one_layer if caches == 2 else entries.one_layer_mla
        entry(*tensors, element_dim, pages, quota)
    else:
        entries = _copy_entries()
        entry = entries.one_layer if caches == 2 else entries.one_layer_mla
        entry(*tensors, element_dim, pages, _stream(dst, src))


# ---------------------------------------------------------------------------- all layers
@op("jitk::transfer_hicache_all_layer", mutates_args=(),  # writes through pointers only
    reference=all_layer_reference, tolerance=_EXACT, cases=lambda: all_layer_cases(False))
def transfer_hicache_all_layer(
    k_ptr_dst: torch.Tensor,
    v_ptr_dst: torch.Tensor,
    indices_dst: torch.Tensor,
    k_ptr_src: torch.Tensor,
    v_ptr_src: torch.Tensor,
    indices_src: torch.Tensor,
    *,
    kv_cache_src_stride_bytes: int,
    kv_cache_dst_stride_bytes: int,
    element_size: int | None = None,
    unroll: int | None = None,
    block_quota: int | None = None,
    page_size: int | None = None,
    num_tokens_src: int | None = None,
    num_tokens_dst: int | None = None,
    kv_cache_src_page_stride_bytes: int | None = None,
    kv_cache_dst_page_stride_bytes: int | None = None,
    method: str = "auto",
    index_granularity: str = "token",
) -> None:
    """For every layer l, in one call: slot indices_dst[i] of layer l's K (and V) cache at
    k_ptr_dst[l] gets slot indices_src[i] of the cache at k_ptr_src[l]. The pointer tables
    are uint64 or int64 tensors, one entry per layer (on the GPU or pinned for the kernel,
    on the CPU for the copy engines). Slot s of a layer is at `ptr + s * stride_bytes`, or,
    with a page stride, at `ptr + (s // page_size) * page_stride_bytes + (s % page_size) *
    stride_bytes`. `element_size` (bytes per row) defaults to the stride and is required
    when the two strides differ. With num_tokens_src / num_tokens_dst, indices at or past
    them are out of range too."""
    _all_layer(2, (k_ptr_dst, v_ptr_dst, indices_dst, k_ptr_src, v_ptr_src, indices_src),
               ("kv_cache_src_stride_bytes", kv_cache_src_stride_bytes),
               ("kv_cache_dst_stride_bytes", kv_cache_dst_stride_bytes),
               ("kv_cache_src_page_stride_bytes", kv_cache_src_page_stride_bytes),
               ("kv_cache_dst_page_stride_bytes", kv_cache_dst_page_stride_bytes),
               element_size, unroll, block_quota, page_size, num_tokens_src, num_tokens_dst,
               method, index_granularity)


@op("jitk::transfer_hicache_all_layer_mla", mutates_args=(),  # writes through pointers only
    reference=all_layer_mla_reference, tolerance=_EXACT,
    cases=lambda: all_layer_cases(True))
def transfer_hicache_all_layer_mla(
    ptr_dst: torch.Tensor,
    indices_dst: torch.Tensor,
    ptr_src: torch.Tensor,
    indices_src: torch.Tensor,
    *,
    cache_src_stride_bytes: int,
    cache_dst_stride_bytes: int,
    element_size: int | None = None,
    unroll: int | None = None,
    block_quota: int | None = None,
    page_size: int | None = None,
    num_tokens_src: int | None = None,
    num_tokens_dst: int | None = None,
    cache_src_page_stride_bytes: int | None = None,
    cache_dst_page_stride_bytes: int | None = None,
    method: str = "auto",
    index_granularity: str = "token",
) -> None:
    """transfer_hicache_all_layer for one cache per layer (MLA)."""
    _all_layer(1, (ptr_dst, indices_dst, ptr_src, indices_src),
               ("cache_src_stride_bytes", cache_src_stride_bytes),
               ("cache_dst_stride_bytes", cache_dst_stride_bytes),
               ("cache_src_page_stride_bytes", cache_src_page_stride_bytes),
               ("cache_dst_page_stride_bytes", cache_dst_page_stride_bytes),
               element_size, unroll, block_quota, page_size, num_tokens_src, num_tokens_dst,
               method, index_granularity)


def _all_layer(caches: int, tensors: tuple, src_stride: tuple, dst_stride: tuple,
               src_page_stride: tuple, dst_page_stride: tuple, element_size: object,
               unroll: object, block_quota: object, page_size: object, num_tokens_src: object,
               num_tokens_dst: object, method: object, index_granularity: object) -> None:
    """The all-layer call; the strides come as (Python name, value)."""
    strides = [checked_int(value, name, 1) for name, value in (src_stride, dst_stride)]
    if element_size is None:
        if strides[0] != strides[1]:
            raise ValueError(f"hicache: element_size is required when the row strides differ "
                             f"({src_stride[0]}={strides[0]}, {dst_stride[0]}={strides[1]})")
        size = _element_size(strides[0], src_stride[0])
    else:
        size = _element_size(checked_int(element_size, "element_size", 1), "element_size")
    hint, pages = _pages(page_size, index_granularity)
    layout = (*strides, size, pages, hint, *(_optional(value, name, 1)
                                       for name, value in (src_page_stride, dst_page_stride)),
              _optional(num_tokens_src, "num_tokens_src", 0),
              _optional(num_tokens_dst, "num_tokens_dst", 0))
    unroll, quota = _unroll(unroll), _optional(block_quota, "block_quota", 1)
    gpu = _gpu_of(tensors[0])  # the pointer tables': the kernel reads them there
    chosen = _method(method, tensors[caches],
                     lambda: size * (_run(tensors[caches], tensors[2 * caches + 1], hint)
                                     if strides[0] == size == strides[1] else 1), gpu)
    if chosen == KERNEL_ON_COPIED_INDICES:
        tensors, chosen = _on_gpu(tensors, (caches, 2 * caches + 1), gpu), "kernel"
    if api_log.noting:
        api_log.note(method=chosen, **_instantiation(chosen, size, unroll, quota))
    if chosen == "kernel":
        entries = _kernel_module(size, unroll)
        entry = entries.all_layer if caches == 2 else entries.all_layer_mla
        entry(*tensors, *layout, quota)
    else:
        entries = _copy_entries()
        entry = entries.all_layer if caches == 2 else entries.all_layer_mla
        entry(*tensors, *layout, current_stream(_tables_gpu(tensors, caches))[1])



# ---------------------------------------------------------------------------- tuning
# The kernel's launch per bucket, its unroll and block quota: tuned by `python -m jitk tune`
# and looked up where a call runs the kernel and names neither. "auto"'s choice between the
# kernel and the copy engines stays the measured rule above: the tuner times CUDA graph
# replays, where a copy-engine call is one recorded node a copy, not what an eager call does.
_DEFAULT_QUOTA = "default"  # the C++ side's: 6 SMs across PCIe, else every SM
# Few candidates: each is checked against the reference on copies of the caches before it is
# timed, which costs more than timing it (an H100 tuned 24 a shape in 10 s, unroll 1 won).
_LAUNCH_KNOBS = {"unroll": (1, DEFAULT_UNROLL), "block_quota": (_DEFAULT_QUOTA, 8, 16, 32)}
# A tuning shape is (indices, bytes a row, direction): 1 host to GPU (load-back), 2 GPU to
# host (write-back), 3 GPU to GPU. A transfer moves bytes: the dtype only sets the rows' type.
_DIRECTIONS = {1: ("host", "gpu"), 2: ("gpu", "host"), 3: ("gpu", "gpu")}
_TUNING_SHAPES = ((4096, 1024, 1), (4096, 1024, 2))


def _launch_bucket(dst: torch.Tensor, src: torch.Tensor, indices: torch.Tensor,
                   element_size: int, pages: int) -> tuple:
    """(row bytes, direction, rows moved rounded up to a power of two)."""
    rows = indices.numel() * pages
    return (element_size, f"{'gpu' if src.is_cuda else 'host'}->{'gpu' if dst.is_cuda else 'host'}",
            1 << max(rows - 1, 0).bit_length())


class _Launch:
    """One choice of the one-layer kernel's launch. A call that names neither knob reads them
    from here after its own checks; called with the op's arguments (as the tuner checks and
    times a choice), it runs the kernel with them. Made, it loads the kernel for its rows'
    bytes (the bucket's first value), so that `python -m jitk tune` builds every candidate's
    module in its parallel prebuild rather than one by one while it times them."""

    def __init__(self, caches: int, knobs: dict, element_size: int) -> None:
        self.caches, self.unroll = caches, knobs["unroll"]
        quota = knobs["block_quota"]
        self.block_quota = None if quota == _DEFAULT_QUOTA else quota
        _kernel_module(element_size, self.unroll)

    def __call__(self, *tensors: torch.Tensor, element_dim: int | None = None,
                 page_size: int | None = None, index_granularity: str = "token",
                 **_: object) -> None:
        _one_layer(self.caches, tensors, element_dim, self.unroll, self.block_quota, page_size,
                   "kernel", index_granularity)


def _launch_space(caches: int) -> TuningSpace:
    """The one-layer transfer's launch knobs, K/V (caches=2) or MLA."""
    def bucket(*tensors: torch.Tensor, element_dim: int | None = None,
               page_size: int | None = None, index_granularity: str = "token",
               **_: object) -> tuple:
        dst, indices, src = tensors[0], tensors[caches], tensors[caches + 1]
        size = resolved_element_dim(dst, element_dim) * dst.element_size()
        return _launch_bucket(dst, src, indices, size,
                              slots_per_index(page_size, index_granularity))

    def sample(shape: tuple, dtype: torch.dtype, device: torch.device) -> tuple:
        if len(shape) != 3 or shape[2] not in _DIRECTIONS or shape[1] % dtype.itemsize:
            raise ValueError(f"a HiCache tuning shape is INDICESxROW_BYTESxDIRECTION (1 load-"
                             f"back, 2 write-back, 3 GPU to GPU), rows a whole number of "
                             f"{dtype} elements; got {'x'.join(map(str, shape))}")
        count, row_bytes, direction = shape
        src_at, dst_at = _DIRECTIONS[direction]
        row = (row_bytes // dtype.itemsize,)
        caches_of = [(make_cache(2 * count, row, dst_at, device, dtype=dtype),
                      make_cache(2 * count, row, src_at, device, dtype=dtype))
                     for _ in range(caches)]
        indices = [torch.randperm(2 * count, device=device)[:count] for _ in range(2)]
        return (*(d for d, _ in caches_of), indices[0], *(s for _, s in caches_of),
                indices[1]), {}

    return TuningSpace(_LAUNCH_KNOBS, bucket,
                       lambda bucket: {"unroll": DEFAULT_UNROLL, "block_quota": _DEFAULT_QUOTA},
                       lambda bucket, knobs: _Launch(caches, knobs, bucket[0]),
                       outputs=("k_cache_dst", "v_cache_dst") if caches == 2 else ("cache_dst",),
                       sample=sample,
                       shapes=_TUNING_SHAPES if caches == 2 else (),  # MLA: --shapes
                       # The quota is a launch argument: one module a row size and unroll.
                       module_key=lambda bucket, knobs: ("hicache", bucket[0], knobs["unroll"]))


_LAUNCH_SPACES = {2: _launch_space(2).attach(transfer_hicache_one_layer),
                  1: _launch_space(1).attach(transfer_hicache_one_layer_mla)}


# Bytes per token and layer of common models: 1, 4 or 8 KV heads of 128 fp16/bf16 (what
# one GPU holds under tensor parallelism), and DeepSeek's MLA latent row (576 bf16).
_COMMON_ELEMENT_SIZES = (256, 1024, 2048, 1152)


def precompile_configs() -> list[tuple[str, Callable[[], object]]]:
    """(label, thunk) for the copy engines and the kernel of each common element size."""
    kernels = {(size, DEFAULT_UNROLL) for size in _COMMON_ELEMENT_SIZES}
    kernels |= {(bucket[0], knobs["unroll"]) for space in _LAUNCH_SPACES.values()
                for bucket, knobs in space.recorded()}  # what the tuning file chose
    return [("copy engines", _copy_module), ("staged write-back", _staged_module),
            *((f"element_size={size} unroll={unroll}",
               functools.partial(_kernel_module, size, unroll)) for size, unroll in
              sorted(kernels))]


# ------------------------------------------------------------------ staged write-back
@op("jitk::transfer_hicache_all_layer_staged_lf_pf",
    mutates_args=("staging_k", "staging_v", "dst_k", "dst_v"),
    reference=staged_reference, tolerance=_EXACT, cases=lambda: staged_cases(False),
    tags=(torch.Tag.cudagraph_unsafe,))  # reads dst_indices on the host, during the call
def transfer_hicache_all_layer_staged_lf_pf(
    k_ptr_src: torch.Tensor,
    v_ptr_src: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    staging_k: torch.Tensor,
    staging_v: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    *,
    page_size: int,
    element_size: int | None = None,
    unroll: int | None = None,
    block_quota: int | None = None,
) -> None:
    """SGLang's staged write-back: whole pages of every layer of a GPU pool (K and V layers
    at k_ptr_src[l] / v_ptr_src[l], rows of element_size bytes back to back) to a pinned host
    pool in page_first layout (dst_k / dst_v: [tokens, layers, ...]), through the GPU staging
    buffers staging_k / staging_v ([tokens, layers, ...], any number of whole pages).

    Page p is named by its first index: src_indices[p * page_size] (a GPU tensor) and
    dst_indices[p * page_size] (a CPU int64 tensor, read during the call and checked
    against the host pool). Per chunk of pages the staging buffers hold, a kernel gathers
    the pages into them, then the copy engines move each page (one copy per run of
    consecutive host pages) to the host, on PyTorch's current stream. `element_size` defaults
    to a staging row; `block_quota` caps the gather's blocks; `unroll` is accepted for
    SGLang's signature and has nothing to tune here."""
    _staged(2, (k_ptr_src, v_ptr_src, src_indices, dst_indices, staging_k, staging_v, dst_k,
                dst_v), page_size, element_size, unroll, block_quota)


@op("jitk::transfer_hicache_all_layer_mla_staged_lf_pf", mutates_args=("staging", "dst"),
    reference=staged_mla_reference, tolerance=_EXACT, cases=lambda: staged_cases(True),
    tags=(torch.Tag.cudagraph_unsafe,))  # reads dst_indices on the host, during the call
def transfer_hicache_all_layer_mla_staged_lf_pf(
    ptr_src: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    staging: torch.Tensor,
    dst: torch.Tensor,
    *,
    page_size: int,
    element_size: int | None = None,
    unroll: int | None = None,
    block_quota: int | None = None,
) -> None:
    """transfer_hicache_all_layer_staged_lf_pf for one cache per layer (MLA, or one side of
    a pool whose K and V rows differ)."""
    _staged(1, (ptr_src, src_indices, dst_indices, staging, dst), page_size, element_size,
            unroll, block_quota)


def _staged(caches: int, tensors: tuple, page_size: object, element_size: object,
            unroll: object, block_quota: object) -> None:
    """The staged call: `tensors` in the entry point's order, caches and staging buffers
    seen as [tokens, layers, row] as SGLang views them."""
    pages = checked_int(page_size, "page_size", 1)
    _unroll(unroll)
    quota = _optional(block_quota, "block_quota", 1)
    first_staging = caches + 2
    buffers = list(tensors)
    for at in range(first_staging, len(buffers)):
        cache = buffers[at]
        if cache.dim() < 2:
            raise ValueError(f"hicache: the staging buffers and host pools are [tokens, layers, "
                             f"...]; got a tensor of shape {tuple(cache.shape)}")
        buffers[at] = cache.view(cache.shape[0], cache.shape[1], -1)
    staging = buffers[first_staging]
    row_bytes = staging.shape[2] * staging.element_size()
    size = row_bytes if element_size is None else checked_int(element_size, "element_size", 1)
    _element_size(size, "element_size" if element_size is not None else "a staging row")
    entry = _staged_module().lf_pf if caches == 2 else _staged_module().lf_pf_mla
    entry(*buffers, pages, size, quota)


# ------------------------------------------------------------------------------ gates
# SGLang's pools ask these before they pick the JIT path: False (with a warning logged)
# where a module cannot be built or loaded, never an exception.
def can_use_hicache_jit_kernel(*, element_size: int, unroll: int | None = None,
                               block_quota: int | None = None,
                               page_size: int | None = None) -> bool:
    """Whether transfers of rows of `element_size` bytes can run (page_size: any hint)."""
    return _can_build(lambda: (_kernel_module(_element_size(element_size, "element_size"),
                                              _unroll(unroll)),
                               _optional(block_quota, "block_quota", 1),
                               checked_int(1 if page_size is None else page_size, "page_size", 1),
                               _copy_module()), element_size)


def can_use_write_back_jit_kernel(*, element_size: int, unroll: int | None = None,
                                  block_quota: int | None = None) -> bool:
    """Whether the staged write-back can run for rows of `element_size` bytes."""
    return _can_build(lambda: (_element_size(element_size, "element_size"), _unroll(unroll),
                               _optional(block_quota, "block_quota", 1), _staged_module()),
                      element_size)


def _can_build(build: Callable[[], object], element_size: object) -> bool:
    try:
        build()
    except Exception as error:  # noqa: BLE001 - a gate answers, whatever the build raised
        logging.getLogger(__name__).warning(
            "hicache: no JIT kernel for element_size=%r: %s", element_size, error)
        return False
    return True
