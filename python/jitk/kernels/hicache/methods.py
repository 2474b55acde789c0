"""Which method a HiCache call runs: the one it names, or "auto"'s choice between the
transfer kernel and the copy engines (the rule is jitk.kernels.hicache's docstring; the
decision table is in tests/test_hicache.py), and what that choice reads of the call."""

from __future__ import annotations

from collections.abc import Callable

import torch

METHODS = ("auto", "kernel", "copy_engine")
# "auto" with host indices: the copy engines from copies of this many bytes on, the smallest
# copy measured to reach a pinned copy_'s bandwidth (a smaller one trails the kernel).
COPY_ENGINE_MIN_COPY_BYTES = 64 << 10
# "auto"'s third choice: the kernel, on indices copied to its GPU during the call.
KERNEL_ON_COPIED_INDICES = "kernel on GPU copies of the indices"


def choose(method: object, indices: torch.Tensor, copy_bytes: Callable[[], int],
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
    return auto_choice(copy_bytes(), kernel_gpu is not None)


def auto_choice(copy_bytes: int, kernel_runs: bool) -> str:
    """"auto" for host indices: the copy engines where their copies are large enough to
    reach the link's bandwidth, else the kernel (on GPU copies of the indices) if it can
    run; tests/test_hicache.py holds the decision table."""
    if copy_bytes >= COPY_ENGINE_MIN_COPY_BYTES or not kernel_runs:
        return "copy_engine"
    return KERNEL_ON_COPIED_INDICES


def run_length(indices_dst: torch.Tensor, indices_src: torch.Tensor, hint: int) -> int:
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


def packed(cache: torch.Tensor, element_dim: int) -> bool:
    """Whether the slots of a page sit back to back in `cache`, so that a copy engine moves
    a page in one copy rather than a row at a time (the C++ side checks the layout)."""
    covered = 1
    for size, stride in zip(reversed(cache.shape), reversed(cache.stride())):
        if covered % element_dim == 0 and size > 1:  # the first dimension past a row
            return covered > element_dim or stride == element_dim
        covered *= size
    return True


def gpu_of(*tensors: torch.Tensor) -> int | None:
    """The GPU of the first tensor on one, or None."""
    return next((t.device.index for t in tensors if t.is_cuda), None)


def on_gpu(tensors: tuple, positions: tuple[int, int], gpu: int) -> tuple:
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
