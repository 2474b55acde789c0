"""The HiCache family's six entry points (jitk.kernels.hicache's docstring says what they
do): their argument checks and method choice, then the kernel or copy-engine call."""

from __future__ import annotations

from collections.abc import Callable

import torch

from jitk.kernels.hicache import methods, modules, tuning
from jitk.kernels.hicache.checks import (
    NOT_GIVEN,
    checked_element_size,
    checked_pages,
    checked_unroll,
    optional_int,
)
from jitk.kernels.hicache.methods import KERNEL_ON_COPIED_INDICES
from jitk.kernels.hicache.reference import (
    all_layer_cases,
    all_layer_mla_reference,
    all_layer_reference,
    checked_int,
    one_layer_cases,
    one_layer_mla_reference,
    one_layer_reference,
    resolved_element_dim,
    staged_cases,
    staged_mla_reference,
    staged_reference,
)
from jitk.runtime.op import Tolerance, op
from jitk.runtime.streams import current_stream
from jitk.tools import api_log

_EXACT = Tolerance(0.0, 0.0)  # a transfer moves bytes


def _tables_gpu(tensors: tuple, caches: int) -> int | None:
    """The GPU the first layer of the copy engines' pointer tables (host tensors) points
    into, source first; None (the current GPU) where neither points into a GPU's memory."""
    for table in (tensors[caches + 1], tensors[0]):
        if table.numel() > 0 and not table.is_cuda:
            device = modules.copy_module().pointer_device(int(table[0]))
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
            "block_quota": "default" if quota == NOT_GIVEN else quota}


def _chosen(method: object, tensors: tuple, caches: int, gpu: int | None, row_bytes: int,
            hint: int, rows_packed: Callable[[], bool]) -> tuple[tuple, str]:
    """The method a one-layer or all-layer call runs, and the tensors it runs on: "auto"'s
    kernel on host indices gets GPU copies of them. A copy engine's copy is a row, or a run
    of `hint` slots where `rows_packed()` and the first page of both index lists agree."""
    indices_dst, indices_src = tensors[caches], tensors[2 * caches + 1]
    chosen = methods.choose(method, indices_dst, lambda: row_bytes * (
        methods.run_length(indices_dst, indices_src, hint) if rows_packed() else 1), gpu)
    if chosen == KERNEL_ON_COPIED_INDICES:
        return methods.on_gpu(tensors, (caches, 2 * caches + 1), gpu), "kernel"
    return tensors, chosen


def _run(entry: str, chosen: str, tensors: tuple, layout: tuple, row_bytes: int, unroll: int,
         quota: int, stream: Callable[[], int]) -> None:
    """Notes the call for the log, then calls `entry` of the kernel module (rows of
    `row_bytes`, `unroll`, `quota`) or of the copy engines' module (on `stream()`)."""
    if api_log.noting:
        api_log.note(method=chosen, **_instantiation(chosen, row_bytes, unroll, quota))
    if chosen == "kernel":
        getattr(modules.kernel_module(row_bytes, unroll), entry)(*tensors, *layout, quota)
    else:
        getattr(modules.copy_entries(), entry)(*tensors, *layout, stream())


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
    element_size = checked_element_size(element_dim * dst.element_size(),
                                        f"element_dim {element_dim} of {dst.dtype}")
    hint, pages = checked_pages(page_size, index_granularity)
    launch_named = unroll is not None or block_quota is not None
    unroll, quota = checked_unroll(unroll), optional_int(block_quota, "block_quota", 1)
    tensors, chosen = _chosen(
        method, tensors, caches, methods.gpu_of(dst, src), element_size, hint,
        lambda: methods.packed(dst, element_dim) and methods.packed(src, element_dim))
    if chosen == "kernel" and not launch_named:  # the tuned launch, or today's default
        launch = LAUNCH_SPACES[caches].lookup(
            tuning.launch_bucket(dst, src, indices_dst, element_size, pages))
        if not isinstance(launch, tuning.Launch):  # JITK_AUTOTUNE=1: tunes this bucket, then runs
            return launch(*tensors, element_dim=element_dim, page_size=page_size,
                          index_granularity=index_granularity)
        unroll, quota = launch.unroll, optional_int(launch.block_quota, "block_quota", 1)
    _run("one_layer" if caches == 2 else "one_layer_mla", chosen, tensors, (element_dim, pages),
         element_size, unroll, quota, lambda: _stream(dst, src))


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
        size = checked_element_size(strides[0], src_stride[0])
    else:
        size = checked_element_size(checked_int(element_size, "element_size", 1), "element_size")
    hint, pages = checked_pages(page_size, index_granularity)
    layout = (*strides, size, pages, hint, *(optional_int(value, name, 1)
                                             for name, value in (src_page_stride, dst_page_stride)),
              optional_int(num_tokens_src, "num_tokens_src", 0),
              optional_int(num_tokens_dst, "num_tokens_dst", 0))
    unroll, quota = checked_unroll(unroll), optional_int(block_quota, "block_quota", 1)
    # The pointer tables' GPU: the kernel reads them there.
    tensors, chosen = _chosen(method, tensors, caches, methods.gpu_of(tensors[0]), size, hint,
                              lambda: strides[0] == size == strides[1])
    _run("all_layer" if caches == 2 else "all_layer_mla", chosen, tensors, layout, size, unroll,
         quota, lambda: current_stream(_tables_gpu(tensors, caches))[1])




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
    checked_unroll(unroll)
    quota = optional_int(block_quota, "block_quota", 1)
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
    checked_element_size(size, "element_size" if element_size is not None else "a staging row")
    entry = modules.staged_module().lf_pf if caches == 2 else modules.staged_module().lf_pf_mla
    entry(*buffers, pages, size, quota)



# The launch each one-layer op runs where a call names neither knob (jitk.kernels.hicache.
# tuning), keyed by the caches a row: built here, once the ops and _one_layer exist.
LAUNCH_SPACES = {2: tuning.launch_space(2, _one_layer).attach(transfer_hicache_one_layer),
                 1: tuning.launch_space(1, _one_layer).attach(transfer_hicache_one_layer_mla)}
