"""HiCache KV transfers: move KV-cache rows by index lists, between GPU memory and pinned
host memory (either way) or within a GPU, on PyTorch's current stream. The calls are
SGLang 0.5.23's, names, forms and defaults (README.md lists what still differs):

    transfer_hicache_one_layer(k_host, v_host, host_slots, k_gpu, v_gpu, gpu_slots)
    # k_host[host_slots[i]] = k_gpu[gpu_slots[i]], and the same for v

Rows and pages. A cache is seen as rows ("slots") of `element_dim` contiguous elements, in
the order of `cache.view(-1, element_dim)`; the slots may sit under one stride (a flat cache,
rows possibly padded) or two (a paged cache: pages of slots, e.g. the [page, page_size, ...]
layer view of SGLang's page_first_direct host layout). By default `element_dim` is the last
dimension, as in SGLang; where that would differ from a whole token's row (every dimension
after the first, jitk's old default) the call is refused and says which to pass. With
`page_size` P, the indices come in runs of P consecutive slots and only the first index of
each run (page) is read: the lists' length must be a multiple of P, and a page may not
straddle two pages of a paged cache. Rows must be a multiple of 16 bytes and 16-byte aligned.
A cache lives on the GPU or in pinned host memory (pageable memory is refused).

Methods (`method=`), every one selectable:
- "kernel": a transfer kernel on `block_quota` SMs (by default 6 when the transfer crosses
  PCIe, the fewest that reach the link's bandwidth, so compute keeps the rest). It reads the
  indices on the GPU, or pinned on the host, at run time (so graph replays see new values),
  and skips a page whose run is out of range. Beside a kernel that fills every SM (a large
  GEMM) its blocks wait for SMs, and its bandwidth drops with them.
- "copy_engine": the GPU's copy engines, one batched submission per call; no SM is used,
  so the bandwidth holds beside compute. The indices (and all-layer pointer tables) must be
  CPU tensors: the call reads them on the host and refuses an index it cannot move. Under
  CUDA graph capture the copies are recorded one node each with the addresses of that
  moment: replays repeat those pages, at about a third of the eager bandwidth. `unroll`
  and `block_quota` do not apply.
- "auto" (default): the kernel for indices on the GPU; for indices on the host, the copy
  engines when one copy would move at least COPY_ENGINE_MIN_PAGE_BYTES (a page of rows
  packed back to back), else the kernel if the indices are pinned (measured on an H100: a
  copy costs the engines and the driver about a microsecond whatever its size).

The all-layer variants take one base address per layer (uint64/int64 pointer tables)
instead of tensors; those addresses are trusted (16-byte aligned, valid for every index
used), and so is the upper bound of the indices unless num_tokens_src / num_tokens_dst are
given. Calls allocate no GPU memory (the copy engines' host-side lists grow once per
thread and are reused) and never synchronize.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from . import api_log
from .cpp_args import make_cpp_args
from .custom_op import Tolerance, op
from .jit import load_jit
from .streams import current_stream

__all__ = [
    "precompile_configs",
    "transfer_hicache_all_layer",
    "transfer_hicache_all_layer_mla",
    "transfer_hicache_one_layer",
    "transfer_hicache_one_layer_mla",
]

METHODS = ("auto", "kernel", "copy_engine")
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
# "auto" with host indices: the copy engines from pages of this many bytes (per cache) on.
COPY_ENGINE_MIN_PAGE_BYTES = 16 << 10

_NOT_GIVEN = -1  # what the C++ side reads as "not given" for optional integers
_CUDA_FILES = ["hicache_layout.cuh", "hicache.cuh", "hicache_copy.cuh"]
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
    module = load_jit("hicache", *args, cuda_files=_CUDA_FILES[:2],
                      cuda_wrappers=[(name, f"{entry}::{name}") for name in _ENTRY_POINTS])
    # Fetched once: a module attribute lookup goes through the FFI each time.
    return _Entries(*(getattr(module, name) for name in _ENTRY_POINTS))


@functools.cache
def _copy_module():
    """The copy-engine entry points: one module for every element size."""
    names = (*_ENTRY_POINTS, "vector_bytes", "element_size_supported", "unroll_supported")
    return load_jit("hicache_copy", cuda_files=[_CUDA_FILES[0], _CUDA_FILES[2]],
                    cuda_wrappers=[(name, f"jitk::hicache::CopyEngine::{name}")
                                   for name in names])


@functools.cache
def _copy_entries() -> _Entries:
    module = _copy_module()
    return _Entries(*(getattr(module, name) for name in _ENTRY_POINTS))


# ------------------------------------------------------------------------- argument checks
# Types are the operator layer's to check (jitk.op, from the annotations); values are here.
def _int(value: int, name: str, least: int) -> int:
    if value < least:
        raise ValueError(f"hicache: {name} must be at least {least}, got {value}")
    return value


def _optional(value: int | None, name: str, least: int) -> int:
    return _NOT_GIVEN if value is None else _int(value, name, least)


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
    value = _int(unroll, "unroll", 1)
    if value not in UNROLLS:
        raise ValueError(f"hicache: unroll must be one of {UNROLLS}, got {value}")
    return value


def _element_dim(cache: torch.Tensor, element_dim: object, name: str) -> int:
    """SGLang's default (the last dimension), refused where it would silently differ from a
    whole token's row (every dimension after the first, jitk's old default)."""
    if element_dim is not None:
        return _int(element_dim, "element_dim", 1)
    last = cache.shape[-1] if cache.dim() > 0 else 1
    whole_row = math.prod(cache.shape[1:])
    if whole_row != last:
        raise ValueError(
            f"hicache: element_dim is ambiguous for '{name}' of shape {tuple(cache.shape)}: "
            f"SGLang's default is the last dimension ({last}), jitk's was every dimension "
            f"after the first ({whole_row}); pass element_dim={whole_row} to move whole "
            f"tokens, or element_dim={last} for rows of the last dimension")
    return last


def _method(method: object, indices: torch.Tensor, copy_bytes: Callable[[], int]) -> str:
    """The method to run; `copy_bytes()` is what one copy-engine copy would move, asked only
    where the choice needs it (not on a kernel call's path)."""
    if method not in METHODS:
        raise ValueError(f"hicache: method must be one of {METHODS}, got {method!r}")
    if method != "auto":
        return method
    if indices.is_cuda:
        return "kernel"
    if not indices.is_pinned() or copy_bytes() >= COPY_ENGINE_MIN_PAGE_BYTES:
        return "copy_engine"
    return "kernel"


def _packed(cache: torch.Tensor, element_dim: int) -> bool:
    """Whether the slots of a page sit back to back in `cache`, so that a copy engine moves
    a page in one copy rather than a row at a time (the C++ side checks the layout)."""
    covered = 1
    for size, stride in zip(reversed(cache.shape), reversed(cache.stride())):
        if covered % element_dim == 0 and size > 1:  # the first dimension past a row
            return covered > element_dim or stride == element_dim
        covered *= size
    return True


def _stream(*tensors: torch.Tensor) -> int:
    """The handle of PyTorch's current stream on the GPU of the first GPU tensor (the
    current GPU if none): the copy engines' calls may have no GPU tensor to tell. Without a
    GPU it is 0, and the C++ checks refuse the call first."""
    devices = [t.device.index for t in tensors if t.is_cuda]
    return current_stream(devices[0] if devices else None)[1]


def _instantiation(method: str, element_size: int, unroll: int, quota: int | None) -> dict:
    """What a call's log notes about the code it runs (JITK_LOGLEVEL=3)."""
    if method != "kernel":
        return {"module": "hicache_copy"}
    return {"kernel": f"jitk::hicache::HiCache<{element_size}, {unroll}>",
            "block_quota": "default" if quota is None else quota}


# ---------------------------------------------------------------------------- references
# Plain torch, as the docstrings above define the transfers (the parity harness and reference
# mode run them). A page whose run leaves its cache, or straddles a paged cache's pages, is
# skipped, as the kernel skips it. One small function per entry point; the argument checks
# stay the kernels'.
def _page_slots(indices: torch.Tensor, page_size: int | None) -> torch.Tensor:
    """Each transfer row's slot: its page's first index, plus its place in the page."""
    indices = indices.to(torch.int64)
    pages = page_size or 1
    place = torch.arange(indices.numel(), device=indices.device)
    return indices[place - place % pages] + place % pages


def _runs_held(first: torch.Tensor, pages: int, slots: int | None,
               page_rows: int | None) -> torch.Tensor:
    """Which page runs lie inside a cache of `slots` slots (None: unbounded), within one of
    its pages of `page_rows` slots (None: not paged)."""
    held = first >= 0
    if slots is not None:
        held &= first <= slots - pages
    if page_rows is not None:
        held &= first % page_rows + pages <= page_rows
    return held


def _slot_rows(cache: torch.Tensor, element_dim: int) -> tuple[torch.Tensor, int, int | None]:
    """(rows, slots, page_rows): the cache as [slot, element] rows in view order (a view, so
    writes land in the cache), its slot count, and the slots of one page where the slots
    step with two strides (None: one)."""
    trailing = next(k for k in range(cache.dim() + 1)
                    if math.prod(cache.shape[k:]) == element_dim)
    leading = cache.flatten(trailing) if trailing < cache.dim() else cache.unsqueeze(-1)
    slots = math.prod(cache.shape[:trailing])
    try:
        return leading.view(slots, element_dim), slots, None
    except RuntimeError:  # a paged cache: pages of [page_rows, element_dim] rows
        page_rows = slots // leading.shape[0]
        return leading.view(leading.shape[0], page_rows, element_dim), slots, page_rows


def _copy_rows(dst: torch.Tensor, indices_dst: torch.Tensor, src: torch.Tensor,
               indices_src: torch.Tensor, element_dim: int | None,
               page_size: int | None) -> None:
    element_dim = element_dim or dst.shape[-1]
    pages = page_size or 1
    (dst_rows, dst_slots, dst_page), (src_rows, src_slots, src_page) = (
        _slot_rows(dst, element_dim), _slot_rows(src, element_dim))
    to = _page_slots(indices_dst, pages)
    take = _page_slots(indices_src, pages).to(to.device)
    place = torch.arange(to.numel(), device=to.device) % pages
    held = (_runs_held(to - place, pages, dst_slots, dst_page)
            & _runs_held(take - place, pages, src_slots, src_page))
    to, take = to[held].to(dst.device), take[held].to(src.device)
    values = (src_rows[take] if src_page is None else
              src_rows[take // src_page, take % src_page]).to(dst.device)
    if dst_page is None:
        dst_rows[to] = values
    else:
        dst_rows[to // dst_page, to % dst_page] = values


def _one_layer_reference(k_cache_dst, v_cache_dst, indices_dst, k_cache_src, v_cache_src,
                         indices_src, *, element_dim=None, unroll=None, block_quota=None,
                         page_size=None, method="auto") -> None:
    for dst, src in ((k_cache_dst, k_cache_src), (v_cache_dst, v_cache_src)):
        _copy_rows(dst, indices_dst, src, indices_src, element_dim, page_size)


def _one_layer_mla_reference(cache_dst, indices_dst, cache_src, indices_src, *,
                             element_dim=None, unroll=None, block_quota=None, page_size=None,
                             method="auto") -> None:
    _copy_rows(cache_dst, indices_dst, cache_src, indices_src, element_dim, page_size)


def _bytes_at(address: int, size: int, device: torch.device) -> torch.Tensor:
    """`size` bytes at a raw address as a uint8 tensor on `device` (a pinned host address is
    reached from the GPU through unified addressing)."""
    storage = torch._C._construct_storage_from_data_pointer(address, device, size)
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _byte_offsets(slots: torch.Tensor, stride: int, page_stride: int | None,
                  pages: int) -> torch.Tensor:
    if page_stride is None:
        return slots * stride
    return slots // pages * page_stride + slots % pages * stride


def _copy_layers(ptrs_dst: list, indices_dst, ptrs_src: list, indices_src, src_stride: int,
                 dst_stride: int, element_size: int | None, page_size: int | None,
                 num_tokens_src: int | None, num_tokens_dst: int | None,
                 src_page_stride: int | None, dst_page_stride: int | None) -> None:
    size, pages = element_size or src_stride, page_size or 1
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    to, take = _page_slots(indices_dst, pages).to(device), _page_slots(indices_src, pages).to(
        device)
    place = torch.arange(to.numel(), device=device) % pages
    held = (_runs_held(to - place, pages, num_tokens_dst,
                       pages if dst_page_stride is not None else None)
            & _runs_held(take - place, pages, num_tokens_src,
                         pages if src_page_stride is not None else None))
    if not held.any():
        return
    row = torch.arange(size, device=device)
    to_at = (_byte_offsets(to[held], dst_stride, dst_page_stride, pages)[:, None] + row)
    take_at = (_byte_offsets(take[held], src_stride, src_page_stride, pages)[:, None] + row)
    for table_dst, table_src in zip(ptrs_dst, ptrs_src):
        for dst_base, src_base in zip(table_dst.tolist(), table_src.tolist()):
            src = _bytes_at(src_base, int(take_at.max()) + 1, device)
            _bytes_at(dst_base, int(to_at.max()) + 1, device)[to_at] = src[take_at]


def _all_layer_reference(k_ptr_dst, v_ptr_dst, indices_dst, k_ptr_src, v_ptr_src,
                         indices_src, *, kv_cache_src_stride_bytes, kv_cache_dst_stride_bytes,
                         element_size=None, unroll=None, block_quota=None, page_size=None,
                         num_tokens_src=None, num_tokens_dst=None,
                         kv_cache_src_page_stride_bytes=None,
                         kv_cache_dst_page_stride_bytes=None, method="auto") -> None:
    _copy_layers([k_ptr_dst, v_ptr_dst], indices_dst, [k_ptr_src, v_ptr_src], indices_src,
                 kv_cache_src_stride_bytes, kv_cache_dst_stride_bytes, element_size, page_size,
                 num_tokens_src, num_tokens_dst, kv_cache_src_page_stride_bytes,
                 kv_cache_dst_page_stride_bytes)


def _all_layer_mla_reference(ptr_dst, indices_dst, ptr_src, indices_src, *,
                             cache_src_stride_bytes, cache_dst_stride_bytes, element_size=None,
                             unroll=None, block_quota=None, page_size=None, num_tokens_src=None,
                             num_tokens_dst=None, cache_src_page_stride_bytes=None,
                             cache_dst_page_stride_bytes=None, method="auto") -> None:
    _copy_layers([ptr_dst], indices_dst, [ptr_src], indices_src, cache_src_stride_bytes,
                 cache_dst_stride_bytes, element_size, page_size, num_tokens_src,
                 num_tokens_dst, cache_src_page_stride_bytes, cache_dst_page_stride_bytes)


# ---------------------------------------------------------------------------- one layer
@op("jitk::transfer_hicache_one_layer", mutates_args=("k_cache_dst", "v_cache_dst"),
    reference=_one_layer_reference, tolerance=_EXACT, cases=lambda: _one_layer_cases(False),
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
) -> None:
    """k_cache_dst[indices_dst[i]] = k_cache_src[indices_src[i]], the same for V."""
    _one_layer(2, (k_cache_dst, v_cache_dst, indices_dst, k_cache_src, v_cache_src,
                   indices_src), element_dim, unroll, block_quota, page_size, method)


@op("jitk::transfer_hicache_one_layer_mla", mutates_args=("cache_dst",),
    reference=_one_layer_mla_reference, tolerance=_EXACT,
    cases=lambda: _one_layer_cases(True),
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
) -> None:
    """cache_dst[indices_dst[i]] = cache_src[indices_src[i]]: one cache (MLA's latent KV)."""
    _one_layer(1, (cache_dst, indices_dst, cache_src, indices_src), element_dim, unroll,
               block_quota, page_size, method)


def _one_layer(caches: int, tensors: tuple, element_dim: object, unroll: object,
               block_quota: object, page_size: object, method: object) -> None:
    """The one-layer call, K/V (caches=2) or MLA: `tensors` in the entry point's order."""
    dst, indices_dst, src = tensors[0], tensors[caches], tensors[caches + 1]
    dst_name = "k_cache_dst" if caches == 2 else "cache_dst"
    element_dim = _element_dim(dst, element_dim, dst_name)
    element_size = _element_size(element_dim * dst.element_size(),
                                 f"element_dim {element_dim} of {dst.dtype}")
    pages = _int(1 if page_size is None else page_size, "page_size", 1)
    unroll, quota = _unroll(unroll), _optional(block_quota, "block_quota", 1)
    chosen = _method(method, indices_dst, lambda: element_size * (
        pages if _packed(dst, element_dim) and _packed(src, element_dim) else 1))
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
    reference=_all_layer_reference, tolerance=_EXACT, cases=lambda: _all_layer_cases(False))
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
               method)


@op("jitk::transfer_hicache_all_layer_mla", mutates_args=(),  # writes through pointers only
    reference=_all_layer_mla_reference, tolerance=_EXACT,
    cases=lambda: _all_layer_cases(True))
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
) -> None:
    """transfer_hicache_all_layer for one cache per layer (MLA)."""
    _all_layer(1, (ptr_dst, indices_dst, ptr_src, indices_src),
               ("cache_src_stride_bytes", cache_src_stride_bytes),
               ("cache_dst_stride_bytes", cache_dst_stride_bytes),
               ("cache_src_page_stride_bytes", cache_src_page_stride_bytes),
               ("cache_dst_page_stride_bytes", cache_dst_page_stride_bytes),
               element_size, unroll, block_quota, page_size, num_tokens_src, num_tokens_dst,
               method)


def _all_layer(caches: int, tensors: tuple, src_stride: tuple, dst_stride: tuple,
               src_page_stride: tuple, dst_page_stride: tuple, element_size: object,
               unroll: object, block_quota: object, page_size: object, num_tokens_src: object,
               num_tokens_dst: object, method: object) -> None:
    """The all-layer call; the strides come as (Python name, value)."""
    strides = [_int(value, name, 1) for name, value in (src_stride, dst_stride)]
    if element_size is None:
        if strides[0] != strides[1]:
            raise ValueError(f"hicache: element_size is required when the row strides differ "
                             f"({src_stride[0]}={strides[0]}, {dst_stride[0]}={strides[1]})")
        size = _element_size(strides[0], src_stride[0])
    else:
        size = _element_size(_int(element_size, "element_size", 1), "element_size")
    pages = _int(1 if page_size is None else page_size, "page_size", 1)
    layout = (*strides, size, pages, *(_optional(value, name, 1)
                                       for name, value in (src_page_stride, dst_page_stride)),
              _optional(num_tokens_src, "num_tokens_src", 0),
              _optional(num_tokens_dst, "num_tokens_dst", 0))
    unroll, quota = _unroll(unroll), _optional(block_quota, "block_quota", 1)
    chosen = _method(method, tensors[caches],
                     lambda: size * (pages if strides[0] == size == strides[1] else 1))
    if api_log.noting:
        api_log.note(method=chosen, **_instantiation(chosen, size, unroll, quota))
    if chosen == "kernel":
        entries = _kernel_module(size, unroll)
        entry = entries.all_layer if caches == 2 else entries.all_layer_mla
        entry(*tensors, *layout, quota)
    else:
        entries = _copy_entries()
        entry = entries.all_layer if caches == 2 else entries.all_layer_mla
        entry(*tensors, *layout, _stream())



# ---------------------------------------------------------------------------- parity cases
def _cache(tokens: int, row: tuple, where: str, device: torch.device, paged: int = 0):
    """A bf16 cache of `tokens` slots of `row`, on the GPU or in pinned host memory (plain
    CPU memory without a GPU); paged: pages of `paged` slots, padded apart (two strides)."""
    on_gpu = where == "gpu" or device.type == "cpu"
    if paged:
        whole = torch.randn(tokens // paged, paged + 3, *row, device=device if on_gpu else "cpu")
        cache = whole.to(torch.bfloat16)[:, :paged]
    else:
        cache = torch.randn(tokens, *row, device=device if on_gpu else "cpu").to(torch.bfloat16)
    return cache if on_gpu else cache.pin_memory()


def _runs(slots: int, count: int, pages: int, device: torch.device,
          out_of_range: bool = False) -> torch.Tensor:
    """`count` distinct page runs of `pages` slots as an index list: each run's first index,
    then garbage (-7) that the transfer must not read."""
    firsts = torch.randperm(slots // pages)[:count] * pages
    if out_of_range:
        firsts[0] = slots  # a page past the end: skipped
    indices = torch.full((count, pages), -7, dtype=torch.int64)
    indices[:, 0] = firsts
    return indices.flatten().to(device)


# (label, dst, src, pages, paged cache, out of range, indices on the host)
_ONE_LAYER = (("host->gpu", "gpu", "host", 1, 0, False, False),
              ("gpu->host", "host", "gpu", 1, 0, False, False),
              ("gpu->gpu pages of 4", "gpu", "gpu", 4, 0, False, False),
              ("host->gpu paged cache", "gpu", "host", 4, 8, False, False),
              ("gpu->gpu a page out of range", "gpu", "gpu", 2, 0, True, False),
              ("host->gpu indices on the host", "gpu", "host", 1, 0, False, True))


def _one_layer_cases(mla: bool) -> list:
    from .testing import Case

    cases = []
    for label, dst_at, src_at, pages, paged, out_of_range, host_indices in _ONE_LAYER:
        def make(device, dst_at=dst_at, src_at=src_at, pages=pages, paged=paged,
                 out_of_range=out_of_range, host_indices=host_indices):
            row = (576,) if mla else (2, 64)
            where = torch.device("cpu") if host_indices else device
            dst_indices = _runs(64, 12, pages, where)
            src_indices = _runs(96, 12, pages, where, out_of_range)
            caches = [(_cache(64, row, dst_at, device, paged), _cache(96, row, src_at, device))
                      for _ in range(1 if mla else 2)]
            kwargs = {"page_size": pages, "element_dim": None if mla else 128}
            return (*(dst for dst, _ in caches), dst_indices, *(src for _, src in caches),
                    src_indices), kwargs
        cases.append(Case(label, make))
    return cases


def _all_layer_cases(mla: bool) -> list:
    from .testing import Case

    def make(device, pages: int, paged: bool):
        layers, row = 3, 256 if mla else 128  # bf16 elements
        caches = {f"{side}{c}[{layer}]": _cache(64 if side == "dst" else 96, (row,),
                                                "gpu" if side == "dst" else "host", device)
                  for side in ("dst", "src") for c in range(1 if mla else 2)
                  for layer in range(layers)}

        def table(side: str, c: int) -> torch.Tensor:
            return torch.tensor([caches[f"{side}{c}[{layer}]"].data_ptr()
                                 for layer in range(layers)], device=device)

        tables = [(table("dst", c), table("src", c)) for c in range(1 if mla else 2)]
        prefix = "cache" if mla else "kv_cache"
        stride = 2 * row
        kwargs = {f"{prefix}_src_stride_bytes": stride, f"{prefix}_dst_stride_bytes": stride,
                  "page_size": pages, "num_tokens_src": 96, "num_tokens_dst": 64}
        if paged:
            kwargs[f"{prefix}_src_page_stride_bytes"] = stride * pages
        args = (*(d for d, _ in tables), _runs(64, 8, pages, device),
                *(s for _, s in tables), _runs(96, 8, pages, device, out_of_range=True))
        watched = {name: cache for name, cache in caches.items() if name.startswith("dst")}
        return args, kwargs, watched

    return [Case("host->gpu, 3 layers", lambda device: make(device, 1, False)),
            Case("host->gpu, 3 layers, pages of 4, page stride",
                 lambda device: make(device, 4, True))]


# Bytes per token and layer of common models: 1, 4 or 8 KV heads of 128 fp16/bf16 (what
# one GPU holds under tensor parallelism), and DeepSeek's MLA latent row (576 bf16).
_COMMON_ELEMENT_SIZES = (256, 1024, 2048, 1152)


def precompile_configs() -> list[tuple[str, Callable[[], object]]]:
    """(label, thunk) for the copy engines and the kernel of each common element size."""
    kernels = [(f"element_size={size}", functools.partial(_kernel_module, size, DEFAULT_UNROLL))
               for size in _COMMON_ELEMENT_SIZES]
    return [("copy engines", _copy_module), *kernels]
