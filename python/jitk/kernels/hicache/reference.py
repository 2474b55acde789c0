"""What the HiCache transfers mean, in plain torch: the meaning of the arguments the kernels
and the references share (element_dim, what one index names), a reference per op (the parity
harness and JITK_REFERENCE run them) and the parity cases (jitk.testing)."""

from __future__ import annotations

import functools
import math

import torch


# ---------------------------------------------------------------------------- arguments
# Types are the operator layer's to check (jitk.op, from the annotations); values are checked
# here and in jitk.kernels.hicache.
def checked_int(value: int, name: str, least: int) -> int:
    if value < least:
        raise ValueError(f"hicache: {name} must be at least {least}, got {value}")
    return value


def resolved_element_dim(cache: torch.Tensor, element_dim: object) -> int:
    """SGLang's default: the last dimension."""
    if element_dim is not None:
        return checked_int(element_dim, "element_dim", 1)
    return cache.shape[-1] if cache.dim() > 0 else 1


def slots_per_index(page_size: int | None, index_granularity: str) -> int:
    """The slots one index names (unchecked: the references use it too)."""
    return (page_size or 1) if index_granularity == "page" else 1


# ---------------------------------------------------------------------------- references
# Plain torch, as jitk.kernels.hicache's docstrings define the transfers (the parity harness and
# reference mode run them), with the ops' parameters and defaults. A run of slots that leaves
# its cache, or straddles a paged cache's pages, is skipped, as the kernel skips it. One small
# function per op; the argument checks stay the kernels', except what the references read to
# move rows.
def _page_slots(indices: torch.Tensor, pages: int) -> torch.Tensor:
    """Each moved row's slot: the first index of its run of `pages` (1: every index its own
    run), plus its place in the run."""
    indices = indices.to(torch.int64)
    place = torch.arange(indices.numel(), device=indices.device)
    return indices[place - place % pages] + place % pages


def _runs_held(first: torch.Tensor, pages: int, slots: int | None,
               page_rows: int | None) -> torch.Tensor:
    """Which runs of `pages` slots lie inside a cache of `slots` slots (None: unbounded),
    within one of its pages of `page_rows` slots (None: not paged)."""
    held = first >= 0
    if slots is not None:
        held &= first <= slots - pages
    if page_rows is not None:
        held &= first % page_rows + pages <= page_rows
    return held


def _moved_slots(indices_dst: torch.Tensor, indices_src: torch.Tensor, pages: int,
                 dst: tuple[int | None, int | None], src: tuple[int | None, int | None],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(destination, source) slots of every row that moves, on `device`: the rows of each
    run held on both sides; `dst` and `src` are each side's (slots, page_rows)."""
    to = _page_slots(indices_dst, pages).to(device)
    take = _page_slots(indices_src, pages).to(device)
    place = torch.arange(to.numel(), device=device) % pages
    held = _runs_held(to - place, pages, *dst) & _runs_held(take - place, pages, *src)
    return to[held], take[held]


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


def _row(page_rows: int | None, slots: torch.Tensor) -> tuple:
    """The index that reaches `slots` in `_slot_rows`'s rows."""
    return (slots,) if page_rows is None else (slots // page_rows, slots % page_rows)


def _copy_rows(dst: torch.Tensor, indices_dst: torch.Tensor, src: torch.Tensor,
               indices_src: torch.Tensor, element_dim: int | None, page_size: int | None,
               index_granularity: str) -> None:
    """One cache's transfer, either granularity: the row copy every one-layer op makes."""
    element_dim = resolved_element_dim(dst, element_dim)
    pages = slots_per_index(page_size, index_granularity)
    dst_rows, dst_slots, dst_page = _slot_rows(dst, element_dim)
    src_rows, src_slots, src_page = _slot_rows(src, element_dim)
    to, take = _moved_slots(indices_dst, indices_src, pages, (dst_slots, dst_page),
                            (src_slots, src_page), dst.device)
    dst_rows[_row(dst_page, to)] = src_rows[_row(src_page, take.to(src.device))].to(dst.device)


def one_layer_reference(k_cache_dst, v_cache_dst, indices_dst, k_cache_src, v_cache_src,
                         indices_src, *, element_dim=None, unroll=None, block_quota=None,
                         page_size=None, method="auto", index_granularity="token") -> None:
    for dst, src in ((k_cache_dst, k_cache_src), (v_cache_dst, v_cache_src)):
        _copy_rows(dst, indices_dst, src, indices_src, element_dim, page_size,
                   index_granularity)


def one_layer_mla_reference(cache_dst, indices_dst, cache_src, indices_src, *,
                             element_dim=None, unroll=None, block_quota=None, page_size=None,
                             method="auto", index_granularity="token") -> None:
    _copy_rows(cache_dst, indices_dst, cache_src, indices_src, element_dim, page_size,
               index_granularity)


def _bytes_at(address: int, size: int, device: torch.device) -> torch.Tensor:
    """`size` bytes at a raw address as a uint8 tensor on `device` (a pinned host address is
    reached from the GPU through unified addressing)."""
    storage = torch._C._construct_storage_from_data_pointer(address, device, size)
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _layer_layout(stride: int, page_stride: int | None, hint: int) -> tuple[int, int | None, int]:
    """(row stride, slots per page or None, page stride) of an all-layer side, read as the
    kernel reads it: pages of `hint` slots, unless the page stride is the row stride's run."""
    if page_stride is None:
        return stride, None, 0
    if hint == 1:  # a page of one slot: its stride is the row stride
        return page_stride, None, 0
    if page_stride == hint * stride:
        return stride, None, 0
    return stride, hint, page_stride


def _offsets(slots: torch.Tensor, layout: tuple[int, int | None, int]) -> torch.Tensor:
    stride, page_rows, page_stride = layout
    if page_rows is None:
        return slots * stride
    return slots // page_rows * page_stride + slots % page_rows * stride


def _copy_layers(ptrs_dst: list, indices_dst, ptrs_src: list, indices_src, src_stride: int,
                 dst_stride: int, element_size: int | None, page_size: int | None,
                 num_tokens_src: int | None, num_tokens_dst: int | None,
                 src_page_stride: int | None, dst_page_stride: int | None,
                 index_granularity: str) -> None:
    """Every all-layer op's copy, either granularity, through the pointer tables."""
    hint, pages = page_size or 1, slots_per_index(page_size, index_granularity)
    src_layout = _layer_layout(src_stride, src_page_stride, hint)
    dst_layout = _layer_layout(dst_stride, dst_page_stride, hint)
    # The memory behind the pointers is reached from where the tables are: the kernel's GPU
    # (pinned host memory through unified addressing), or the CPU for CPU tensors' addresses.
    device = ptrs_dst[0].device
    to, take = _moved_slots(indices_dst, indices_src, pages, (num_tokens_dst, dst_layout[1]),
                            (num_tokens_src, src_layout[1]), device)
    if not to.numel():
        return
    row = torch.arange(element_size or src_stride, device=device)
    to_at = _offsets(to, dst_layout)[:, None] + row
    take_at = _offsets(take, src_layout)[:, None] + row
    for table_dst, table_src in zip(ptrs_dst, ptrs_src):
        for dst_base, src_base in zip(table_dst.tolist(), table_src.tolist()):
            src = _bytes_at(src_base, int(take_at.max()) + 1, device)
            _bytes_at(dst_base, int(to_at.max()) + 1, device)[to_at] = src[take_at]


def all_layer_reference(k_ptr_dst, v_ptr_dst, indices_dst, k_ptr_src, v_ptr_src,
                         indices_src, *, kv_cache_src_stride_bytes, kv_cache_dst_stride_bytes,
                         element_size=None, unroll=None, block_quota=None, page_size=None,
                         num_tokens_src=None, num_tokens_dst=None,
                         kv_cache_src_page_stride_bytes=None,
                         kv_cache_dst_page_stride_bytes=None, method="auto",
                         index_granularity="token") -> None:
    _copy_layers([k_ptr_dst, v_ptr_dst], indices_dst, [k_ptr_src, v_ptr_src], indices_src,
                 kv_cache_src_stride_bytes, kv_cache_dst_stride_bytes, element_size, page_size,
                 num_tokens_src, num_tokens_dst, kv_cache_src_page_stride_bytes,
                 kv_cache_dst_page_stride_bytes, index_granularity)


def all_layer_mla_reference(ptr_dst, indices_dst, ptr_src, indices_src, *,
                             cache_src_stride_bytes, cache_dst_stride_bytes, element_size=None,
                             unroll=None, block_quota=None, page_size=None, num_tokens_src=None,
                             num_tokens_dst=None, cache_src_page_stride_bytes=None,
                             cache_dst_page_stride_bytes=None, method="auto",
                             index_granularity="token") -> None:
    _copy_layers([ptr_dst], indices_dst, [ptr_src], indices_src, cache_src_stride_bytes,
                 cache_dst_stride_bytes, element_size, page_size, num_tokens_src,
                 num_tokens_dst, cache_src_page_stride_bytes, cache_dst_page_stride_bytes,
                 index_granularity)


def _write_back_pages(tables: list, src_indices: torch.Tensor, dst_indices: torch.Tensor,
                      stagings: list, dsts: list, page_size: int) -> None:
    """The staged write-back of each cache: its pages of every layer (rows back to back at
    the table's addresses) gathered into the staging buffer a chunk at a time, each chunk
    then written to its host pages."""
    take, to = _page_slots(src_indices, page_size), _page_slots(dst_indices, page_size)
    if not to.numel():
        return
    for table, staging, dst in zip(tables, stagings, dsts):
        staging, dst = (t.view(t.shape[0], t.shape[1], -1) for t in (staging, dst))
        row = staging.shape[2]
        size = (int(take.max()) + 1) * row * staging.element_size()
        pages = torch.stack([_bytes_at(base, size, staging.device).view(staging.dtype)
                             .view(-1, row)[take.to(staging.device)]
                             for base in table.tolist()], dim=1)
        chunk = staging.shape[0] // page_size * page_size
        for first in range(0, to.numel(), chunk):
            staged = staging[:min(chunk, to.numel() - first)]
            staged.copy_(pages[first:first + chunk])
            dst[to[first:first + chunk]] = staged.to(dst.device)


def staged_reference(k_ptr_src, v_ptr_src, src_indices, dst_indices, staging_k, staging_v,
                      dst_k, dst_v, *, page_size, element_size=None, unroll=None,
                      block_quota=None) -> None:
    _write_back_pages([k_ptr_src, v_ptr_src], src_indices, dst_indices,
                      [staging_k, staging_v], [dst_k, dst_v], page_size)


def staged_mla_reference(ptr_src, src_indices, dst_indices, staging, dst, *, page_size,
                          element_size=None, unroll=None, block_quota=None) -> None:
    _write_back_pages([ptr_src], src_indices, dst_indices, [staging], [dst], page_size)


# ---------------------------------------------------------------------------- parity cases
def make_cache(tokens: int, row: tuple, where: str, device: torch.device, paged: int = 0,
           dtype: torch.dtype = torch.bfloat16):
    """A cache of `tokens` slots of `row`, on the GPU or in pinned host memory (plain CPU
    memory without a GPU); paged: pages of `paged` slots, padded apart (two strides)."""
    on_gpu = where == "gpu" or device.type == "cpu"
    if paged:
        whole = torch.randn(tokens // paged, paged + 3, *row, device=device if on_gpu else "cpu")
        cache = whole.to(dtype)[:, :paged]
    else:
        cache = torch.randn(tokens, *row, device=device if on_gpu else "cpu").to(dtype)
    return cache if on_gpu else cache.pin_memory()


def _index_list(slots: int, count: int, run: int, first_only: bool, device: torch.device,
                out_of_range: bool = False) -> torch.Tensor:
    """`count` distinct runs of `run` consecutive slots (SGLang's pages) as an index list;
    first_only: each run's first index, then garbage (-7) that the transfer must not read.
    out_of_range: the first run starts past the end (skipped)."""
    firsts = torch.randperm(slots // run)[:count] * run
    if out_of_range:
        firsts[0] = slots
    indices = firsts[:, None] + torch.arange(run)
    if first_only:
        indices[:, 1:] = -7
    return indices.flatten().to(device)


# (label, dst, src, page_size, index_granularity, paged cache, out of range, host indices)
_ONE_LAYER = (("host->gpu", "gpu", "host", None, "token", 0, False, False),
              ("gpu->host", "host", "gpu", 1, "token", 0, False, False),
              ("gpu->gpu token indices, page_size 4", "gpu", "gpu", 4, "token", 0, False,
               False),
              ("gpu->gpu an index per page of 4", "gpu", "gpu", 4, "page", 0, False, False),
              ("host->gpu paged cache, token indices", "gpu", "host", 4, "token", 8, False,
               False),
              ("host->gpu paged cache, an index per page", "gpu", "host", 4, "page", 8, False,
               False),
              ("gpu->gpu a slot out of range", "gpu", "gpu", None, "token", 0, True, False),
              ("gpu->gpu a page out of range", "gpu", "gpu", 2, "page", 0, True, False),
              ("host->gpu indices on the host", "gpu", "host", 4, "token", 0, False, True))


def one_layer_cases(mla: bool) -> list:
    from jitk.tools.testing import Case

    def make(device, dst_at, src_at, page_size, granularity, paged, out_of_range,
             host_indices):
        row = (576,) if mla else (2, 64)  # MLA: element_dim defaults to the last dimension
        where = torch.device("cpu") if host_indices else device
        run, first_only = page_size or 1, granularity == "page"
        dst_indices = _index_list(64, 12, run, first_only, where)
        src_indices = _index_list(96, 12, run, first_only, where, out_of_range)
        caches = [(make_cache(64, row, dst_at, device, paged), make_cache(96, row, src_at, device))
                  for _ in range(1 if mla else 2)]
        kwargs = {"page_size": page_size, "index_granularity": granularity,
                  "element_dim": None if mla else 128}
        return (*(dst for dst, _ in caches), dst_indices, *(src for _, src in caches),
                src_indices), kwargs

    return [Case(label, functools.partial(make, **dict(zip(
        ("dst_at", "src_at", "page_size", "granularity", "paged", "out_of_range",
         "host_indices"), values)))) for label, *values in _ONE_LAYER]


def _pointer_table(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], device=device)


def all_layer_cases(mla: bool) -> list:
    from jitk.tools.testing import Case

    def make(device, page_size: int | None, granularity: str, paged: bool):
        layers, row, run = 3, 256 if mla else 128, page_size or 1  # bf16 elements
        stride = 2 * row
        # paged: the source's pages of page_size slots are two rows apart, so its slot 95
        # is row 95 // run * (run + 2) + run - 1 of its layer
        src_rows = 96 // run * (run + 2) if paged else 96
        caches = {f"{side}{c}[{layer}]": make_cache(64, (row,), "gpu", device) if side == "dst"
                  else make_cache(src_rows, (row,), "host", device)
                  for side in ("dst", "src") for c in range(1 if mla else 2)
                  for layer in range(layers)}
        tables = [[_pointer_table([caches[f"{side}{c}[{layer}]"] for layer in range(layers)],
                                  device) for side in ("dst", "src")]
                  for c in range(1 if mla else 2)]
        prefix = "cache" if mla else "kv_cache"
        kwargs = {f"{prefix}_src_stride_bytes": stride, f"{prefix}_dst_stride_bytes": stride,
                  "page_size": page_size, "num_tokens_src": 96, "num_tokens_dst": 64,
                  "index_granularity": granularity}
        if paged:
            kwargs[f"{prefix}_src_page_stride_bytes"] = stride * (run + 2)
        first_only = granularity == "page"
        args = (*(d for d, _ in tables), _index_list(64, 8, run, first_only, device),
                *(s for _, s in tables),
                _index_list(96, 8, run, first_only, device, out_of_range=True))
        # every cache stays alive with the case: the tables point into them
        return args, kwargs, caches

    return [Case("host->gpu, 3 layers", lambda device: make(device, None, "token", False)),
            Case("host->gpu, 3 layers, token indices, page_size 4, page stride",
                 lambda device: make(device, 4, "token", True)),
            Case("host->gpu, 3 layers, an index per page of 4, page stride",
                 lambda device: make(device, 4, "page", True))]


def staged_cases(mla: bool) -> list:
    from jitk.tools.testing import Case

    def make(device, page_size: int, staged_pages: int):
        layers, row, count = 3, 256 if mla else 128, 5  # 5 pages of bf16 rows
        caches = range(1 if mla else 2)
        pools = {f"src{c}[{layer}]": make_cache(16 * page_size, (row,), "gpu", device)
                 for c in caches for layer in range(layers)}
        tables = [_pointer_table([pools[f"src{c}[{layer}]"] for layer in range(layers)],
                                 device) for c in caches]
        stagings = [make_cache(staged_pages * page_size, (layers, row), "gpu", device)
                    for _ in caches]
        dsts = [make_cache(8 * page_size, (layers, row), "host", device) for _ in caches]
        args = (*tables, _index_list(16 * page_size, count, page_size, True, device),
                _index_list(8 * page_size, count, page_size, True, torch.device("cpu")),
                *stagings, *dsts)
        # the source layers stay alive with the case (the tables point into them); compared
        # too: the write-back must not write them
        return args, {"page_size": page_size}, pools

    staging = ("staging",) if mla else ("staging_k", "staging_v")
    return [Case("pages of 4, staging for 2 (3 chunks)", lambda device: make(device, 4, 2),
                 outputs=staging),
            Case("pages of 1, staging for all", lambda device: make(device, 1, 8),
                 outputs=staging)]
