"""The one-layer kernel's launch per bucket, its unroll and block quota: tuned by `python -m
jitk tune` and looked up where a call runs the kernel and names neither; and what `python -m
jitk precompile` builds. "auto"'s choice between the kernel and the copy engines stays the
measured rule of jitk.kernels.hicache.methods: the tuner times CUDA graph replays, where a
copy-engine call is one recorded node a copy, not what an eager call does."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from jitk.kernels.hicache import modules
from jitk.kernels.hicache.checks import DEFAULT_UNROLL
from jitk.kernels.hicache.reference import make_cache, resolved_element_dim, slots_per_index
from jitk.tools.autotune import TuningSpace

DEFAULT_QUOTA = "default"  # the C++ side's: 6 SMs across PCIe, else every SM
# Few candidates: each is checked against the reference on copies of the caches before it is
# timed, which costs more than timing it.
LAUNCH_KNOBS = {"unroll": (1, DEFAULT_UNROLL), "block_quota": (DEFAULT_QUOTA, 8, 16, 32)}
# A tuning shape is (indices, bytes a row, direction): 1 host to GPU (load-back), 2 GPU to
# host (write-back), 3 GPU to GPU. A transfer moves bytes: the dtype only sets the rows' type.
DIRECTIONS = {1: ("host", "gpu"), 2: ("gpu", "host"), 3: ("gpu", "gpu")}
TUNING_SHAPES = ((4096, 1024, 1), (4096, 1024, 2))
# Bytes per token and layer of common models: 1, 4 or 8 KV heads of 128 fp16/bf16 (what
# one GPU holds under tensor parallelism), and DeepSeek's MLA latent row (576 bf16).
COMMON_ELEMENT_SIZES = (256, 1024, 2048, 1152)


def launch_bucket(dst: torch.Tensor, src: torch.Tensor, indices: torch.Tensor,
                  element_size: int, pages: int) -> tuple:
    """(row bytes, direction, rows moved rounded up to a power of two)."""
    rows = indices.numel() * pages
    return (element_size, f"{'gpu' if src.is_cuda else 'host'}->{'gpu' if dst.is_cuda else 'host'}",
            1 << max(rows - 1, 0).bit_length())


class Launch:
    """One choice of the one-layer kernel's launch. A call that names neither knob reads them
    from here after its own checks; called with the op's arguments (as the tuner checks and
    times a choice), it runs the kernel with them through `run` (the one-layer call). Made,
    it loads the kernel for its rows' bytes (the bucket's first value), so that `python -m
    jitk tune` builds every candidate's module in its parallel prebuild rather than one by
    one while it times them."""

    def __init__(self, caches: int, knobs: dict, element_size: int, run: Callable) -> None:
        self.caches, self.unroll, self.run = caches, knobs["unroll"], run
        quota = knobs["block_quota"]
        self.block_quota = None if quota == DEFAULT_QUOTA else quota
        modules.kernel_module(element_size, self.unroll)

    def __call__(self, *tensors: torch.Tensor, element_dim: int | None = None,
                 page_size: int | None = None, index_granularity: str = "token",
                 **_: object) -> None:
        self.run(self.caches, tensors, element_dim, self.unroll, self.block_quota, page_size,
                 "kernel", index_granularity)


def launch_space(caches: int, run: Callable) -> TuningSpace:
    """The one-layer transfer's launch knobs, K/V (caches=2) or MLA; `run` is the one-layer
    call a launch runs."""
    def bucket(*tensors: torch.Tensor, element_dim: int | None = None,
               page_size: int | None = None, index_granularity: str = "token",
               **_: object) -> tuple:
        dst, indices, src = tensors[0], tensors[caches], tensors[caches + 1]
        size = resolved_element_dim(dst, element_dim) * dst.element_size()
        return launch_bucket(dst, src, indices, size,
                             slots_per_index(page_size, index_granularity))

    def sample(shape: tuple, dtype: torch.dtype, device: torch.device) -> tuple:
        if len(shape) != 3 or shape[2] not in DIRECTIONS or shape[1] % dtype.itemsize:
            raise ValueError(f"a HiCache tuning shape is INDICESxROW_BYTESxDIRECTION (1 load-"
                             f"back, 2 write-back, 3 GPU to GPU), rows a whole number of "
                             f"{dtype} elements; got {'x'.join(map(str, shape))}")
        count, row_bytes, direction = shape
        src_at, dst_at = DIRECTIONS[direction]
        row = (row_bytes // dtype.itemsize,)
        caches_of = [(make_cache(2 * count, row, dst_at, device, dtype=dtype),
                      make_cache(2 * count, row, src_at, device, dtype=dtype))
                     for _ in range(caches)]
        indices = [torch.randperm(2 * count, device=device)[:count] for _ in range(2)]
        return (*(d for d, _ in caches_of), indices[0], *(s for _, s in caches_of),
                indices[1]), {}

    return TuningSpace(LAUNCH_KNOBS, bucket,
                       lambda bucket: {"unroll": DEFAULT_UNROLL, "block_quota": DEFAULT_QUOTA},
                       lambda bucket, knobs: Launch(caches, knobs, bucket[0], run),
                       outputs=("k_cache_dst", "v_cache_dst") if caches == 2 else ("cache_dst",),
                       sample=sample,
                       shapes=TUNING_SHAPES if caches == 2 else (),  # MLA: --shapes
                       # The quota is a launch argument: one module a row size and unroll.
                       module_key=lambda bucket, knobs: ("hicache", bucket[0], knobs["unroll"]))


def precompile_configs(spaces) -> list[tuple[str, Callable[[], object]]]:
    """(label, thunk) for the copy engines and the kernel of each common element size, and
    each launch the tuning file chose for `spaces` (the launch spaces)."""
    kernels = {(size, DEFAULT_UNROLL) for size in COMMON_ELEMENT_SIZES}
    kernels |= {(bucket[0], knobs["unroll"]) for space in spaces
                for bucket, knobs in space.recorded()}
    return [("copy engines", modules.copy_module), ("staged write-back", modules.staged_module),
            *((f"element_size={size} unroll={unroll}",
               functools.partial(modules.kernel_module, size, unroll)) for size, unroll in
              sorted(kernels))]
