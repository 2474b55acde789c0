"""What bench_hicache.py times: its pools and index sets, and each way of moving a layer's K+V
(jitk's methods, SGLang's kernels, gathers, contiguous copy_ references, the staged write-back)
as zero-argument calls."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import torch

from jitk.kernels import hicache

MIB = 1 << 20
HOST_POOL = 256 * 1024  # tokens
GPU_POOL = 64 * 1024
INDEX_SETS = 8
PLACES = {"d2h": ("cuda", "cpu"), "h2d": ("cpu", "cuda"), "d2d": ("cuda", "cuda")}


def random_rows(rows: int, row_bytes: int, where: str) -> torch.Tensor:
    """fp16 rows of random data (never zeros), on the GPU or pinned on the host."""
    shape = (rows, row_bytes // 2)
    data = (torch.empty(shape, dtype=torch.float16, device="cuda") if where == "cuda" else
            torch.empty(shape, dtype=torch.float16, pin_memory=True))
    step = max(1, (256 * MIB) // row_bytes)
    for first in range(0, rows, step):  # a chunk at a time: no second copy of the pool
        chunk = torch.randn(min(step, rows - first), row_bytes // 2, device="cuda").half()
        data[first:first + chunk.shape[0]].copy_(chunk)
    torch.cuda.synchronize()
    return data


@dataclass
class Variant:
    """A way to run one layer's transfer: a jitk method with its options, indices on the
    GPU or pinned on the host; `transfer` replaces jitk's call (SGLang's kernels)."""
    label: str
    method: str
    host_indices: bool = False
    options: dict = field(default_factory=dict)
    transfer: object = None


def variants(sms: int, peers: bool) -> list[Variant]:
    """The kernel as jitk runs it by default and on every SM (its old default), the copy
    engines, "auto" with host indices (the kernel on GPU copies of them below 64 KiB pages),
    and SGLang 0.5.23's register and TMA kernels (GPU indices, its defaults) with --peers."""
    found = [Variant("kernel", "kernel"),
             Variant(f"kernel, {sms} blocks (all SMs)", "kernel", options={"block_quota": sms}),
             Variant("copy_engine", "copy_engine", host_indices=True),
             Variant("auto, host indices", "auto", host_indices=True)]
    if peers:
        try:
            import sgl523
        except ImportError as error:
            print(f"SGLang 0.5.23's kernels did not load: {error}", flush=True)
            return found
        found += [Variant("sglang 0.5.23 register", "sglang",
                          transfer=sgl523.transfer_hicache_one_layer),
                  Variant("sglang 0.5.23 tma", "sglang",
                          transfer=sgl523.transfer_hicache_one_layer_tma)]
    return found


@functools.cache
def pools_for(row_bytes: int) -> Pools:
    return Pools(row_bytes)


class Pools:
    """K and V pools for one row size: HOST_POOL tokens pinned, GPU_POOL on the GPU (made
    once per row size and kept: 2.75 GB of pinned memory for the three sizes)."""

    def __init__(self, row_bytes: int):
        self.row_bytes = row_bytes
        self.host = [random_rows(HOST_POOL, row_bytes, "cpu") for _ in range(2)]
        self.gpu = [random_rows(GPU_POOL, row_bytes, "cuda") for _ in range(2)]

    def sides(self, direction: str):
        src_at, dst_at = PLACES[direction]
        pick = lambda at: self.gpu if at == "cuda" else self.host  # noqa: E731
        return pick(dst_at), pick(src_at)


def page_indices(tokens: int, pool: int, page: int) -> torch.Tensor:
    """`tokens` slot numbers in runs of `page`, the runs at random distinct pages."""
    firsts = torch.randperm(pool // page)[:tokens // page] * page
    return (firsts[:, None] + torch.arange(page)).flatten()


def layer_calls(variant: Variant, pools: Pools, direction: str, tokens: int, page: int):
    """One zero-argument call per index set, each a whole layer's K+V transfer."""
    return caches_calls(variant, *pools.sides(direction), tokens, page)


def caches_calls(variant: Variant, dst: list, src: list, tokens: int, page: int):
    """layer_calls between given K and V caches (fp16 rows of their last dimension)."""
    element_dim = dst[0].shape[-1]
    calls = []
    for _ in range(INDEX_SETS):
        idx = [page_indices(tokens, side[0].numel() // element_dim, page) for side in (dst, src)]
        if variant.host_indices:
            idx = [i.pin_memory() for i in idx]
        else:
            idx = [i.cuda() for i in idx]
        if variant.transfer is not None:
            calls.append(lambda i=idx: variant.transfer(dst[0], dst[1], i[0], src[0], src[1],
                                                        i[1], element_dim=element_dim))
            continue
        calls.append(lambda i=idx: hicache.transfer_hicache_one_layer(
            dst[0], dst[1], i[0], src[0], src[1], i[1], page_size=page,
            element_dim=element_dim, method=variant.method, **variant.options))
    return calls


def gathered_write_back_calls(pools: Pools, tokens: int, page: int):
    """A write-back as a GPU gather of the pages into a staging buffer (the kernel, GPU to
    GPU) and one copy-engine copy per cache into host slots that follow each other (as a
    host allocator hands out fresh slots): the copy engines move one large block."""
    row = pools.row_bytes // 2
    staging = [torch.empty(tokens, row, dtype=torch.float16, device="cuda") for _ in range(2)]
    staged = torch.arange(tokens)
    staged_gpu = staged.cuda()
    calls = []
    for _ in range(INDEX_SETS):
        src_idx = page_indices(tokens, GPU_POOL, page).cuda()
        first = int(torch.randint(0, HOST_POOL - tokens, ()))
        host_idx = torch.arange(first, first + tokens)

        def call(src_idx=src_idx, host_idx=host_idx):
            hicache.transfer_hicache_one_layer(staging[0], staging[1], staged_gpu,
                                               pools.gpu[0], pools.gpu[1], src_idx,
                                               method="kernel", block_quota=8)
            hicache.transfer_hicache_one_layer(pools.host[0], pools.host[1], host_idx,
                                               staging[0], staging[1], staged,
                                               method="copy_engine")
        calls.append(call)
    return calls


def cpu_gathered_load_calls(pools: Pools, tokens: int, page: int):
    """A load-back as a gather of the host pages by CPU threads (torch's index_select) into
    a pinned staging buffer, then one copy-engine copy per cache into GPU slots that follow
    each other. A staging buffer is rewritten only after its last copy has finished."""
    row = pools.row_bytes // 2
    calls = []
    for _ in range(INDEX_SETS):
        host_idx = page_indices(tokens, HOST_POOL, page)
        first = int(torch.randint(0, GPU_POOL - tokens, ()))
        staging = [torch.empty(tokens, row, dtype=torch.float16, pin_memory=True)
                   for _ in range(2)]
        done = torch.cuda.Event()
        done.record()

        def call(host_idx=host_idx, first=first, staging=staging, done=done):
            done.synchronize()
            for cache in range(2):
                torch.index_select(pools.host[cache], 0, host_idx, out=staging[cache])
                pools.gpu[cache][first:first + tokens].copy_(staging[cache], non_blocking=True)
            done.record()
        calls.append(call)
    return calls


def contiguous_calls(pools: Pools, direction: str, tokens: int):
    """The reference: K and V of a layer as one contiguous copy_ each."""
    dst, src = pools.sides(direction)
    return [lambda: [d[:tokens].copy_(s[:tokens], non_blocking=True) for d, s in zip(dst, src)]]


def staged_call(provider, buffers: tuple, src: torch.Tensor, dst: torch.Tensor):
    """A zero-argument staged write-back by `provider` (a module with SGLang's two staged
    functions), K/V or MLA by the number of pointer tables."""
    tables, staging, host, page = buffers
    if len(tables) == 2:
        return lambda: provider.transfer_hicache_all_layer_staged_lf_pf(
            tables[0], tables[1], src, dst, staging[0], staging[1], host[0], host[1],
            page_size=page)
    return lambda: provider.transfer_hicache_all_layer_mla_staged_lf_pf(
        tables[0], src, dst, staging[0], host[0], page_size=page)


def check_staged(name: str, call, indices, device: list, host: list) -> None:
    """One staged call against torch: every host page it names equals the GPU page."""
    src, dst = indices
    for h in host:
        h.view(torch.uint8).fill_(0x7B)
    call()
    torch.cuda.synchronize()
    for layers, h in zip(device, host):
        want = torch.stack([layer[src] for layer in layers], dim=1).cpu()
        if not torch.equal(h[dst].view(torch.uint8), want.view(torch.uint8)):
            raise AssertionError(f"staged write-back by {name}: host pages differ")


def same_size_copy(direction: str, nbytes: int):
    """A contiguous copy_ of the same bytes between the same kinds of memory."""
    src_at, dst_at = PLACES[direction]
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    src = src if src_at == "cuda" else src.cpu().pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_at, pin_memory=dst_at == "cpu")
    return lambda: dst.copy_(src, non_blocking=True)


def rotating(calls):
    cycle = itertools.cycle(calls)
    return lambda: next(cycle)()


def torch_index_call(direction, dst, src, idx_dst, idx_src):
    """Naive torch: the gather runs where the source is, the scatter where the destination
    is, with a copy between them (the host side's indices on the host)."""
    if direction == "d2h":
        idx_dst = idx_dst.cpu()
    elif direction == "h2d":
        idx_src = idx_src.cpu()
    to = dst[0].device

    def call():
        for d, s in zip(dst, src):
            d[idx_dst] = s[idx_src].to(to, non_blocking=True)
    return call


def solo_variants() -> list[Variant]:
    return [Variant("kernel", "kernel"), Variant("copy_engine", "copy_engine", True)]
