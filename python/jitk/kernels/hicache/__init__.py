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
  debugging_and_performance.md), never one below half of the best (see
  methods.auto_choice). Indices on the GPU: the kernel. Indices on the host: the copy
  engines where one copy moves
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

from collections.abc import Callable

from jitk.kernels.hicache import ops, tuning
from jitk.kernels.hicache.checks import (  # public here before the family was split
    DEFAULT_UNROLL as DEFAULT_UNROLL,
)
from jitk.kernels.hicache.checks import (
    INDEX_GRANULARITIES as INDEX_GRANULARITIES,
)
from jitk.kernels.hicache.checks import (
    MAX_ELEMENT_BYTES as MAX_ELEMENT_BYTES,
)
from jitk.kernels.hicache.checks import (
    UNROLLS as UNROLLS,
)
from jitk.kernels.hicache.checks import (
    VECTOR_BYTES as VECTOR_BYTES,
)
from jitk.kernels.hicache.gates import can_use_hicache_jit_kernel, can_use_write_back_jit_kernel
from jitk.kernels.hicache.methods import (  # public here before the family was split
    COPY_ENGINE_MIN_COPY_BYTES as COPY_ENGINE_MIN_COPY_BYTES,
)
from jitk.kernels.hicache.methods import (
    KERNEL_ON_COPIED_INDICES as KERNEL_ON_COPIED_INDICES,
)
from jitk.kernels.hicache.methods import (
    METHODS as METHODS,
)
from jitk.kernels.hicache.ops import (
    transfer_hicache_all_layer,
    transfer_hicache_all_layer_mla,
    transfer_hicache_all_layer_mla_staged_lf_pf,
    transfer_hicache_all_layer_staged_lf_pf,
    transfer_hicache_one_layer,
    transfer_hicache_one_layer_mla,
)

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


def precompile_configs() -> list[tuple[str, Callable[[], object]]]:
    """(label, thunk) for the copy engines, the kernel of each common element size and each
    launch the tuning file chose (python/jitk/runtime/registry.py finds this def here)."""
    return tuning.precompile_configs(ops.LAUNCH_SPACES.values())
