"""PyTorch's current CUDA stream as the raw handle a C++ launcher takes, for calls that have
no CUDA tensor through which tvm-ffi would pass it (host flags, copies between host tensors),
and a `device=` argument read as a CUDA device."""

from __future__ import annotations

import torch


def cuda_device(device: torch.device | str | int | None, what: str,
                hint: str = "") -> torch.device:
    """`device` as a CUDA device with its index: an index, "cuda" (the current GPU), "cuda:1",
    a torch.device, or None (the current GPU; device 0 where PyTorch has none). Anything else
    raises ValueError naming `what` (the argument, as its caller spells it), then `hint`."""
    try:
        if device is None or (isinstance(device, int) and not isinstance(device, bool)):
            resolved = torch.device("cuda", device)
        else:
            resolved = torch.device(device)
    except (RuntimeError, TypeError):
        resolved = None
    if resolved is None or resolved.type != "cuda":
        raise ValueError(f"{what} must be a CUDA device (an index, 'cuda', 'cuda:1'), got "
                         f"{device!r}" + (f"; {hint}" if hint else ""))
    if resolved.index is None:
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available()
                            else 0)
    return resolved


def current_stream(device: int | None = None) -> tuple[int, int]:
    """(device index, cudaStream_t) of PyTorch's current stream on `device` (default: the
    current GPU), or (-1, 0) where PyTorch has no GPU; the launchers' own checks then say
    what is wrong. Any other failure (a bad device index, a CUDA error) is raised. The raw
    handle, as torch._dynamo reads it: building a torch.cuda.Stream object a call costs host
    time on every launch (docs/developer_guide/debugging_and_performance.md)."""
    try:
        if device is None:
            device = torch.cuda.current_device()
        return device, torch._C._cuda_getCurrentRawStream(device)
    except (AssertionError, AttributeError, RuntimeError):
        # A CPU-only build asserts or lacks the binding; a CUDA build without GPUs raises.
        if torch.cuda.is_available():
            raise
        return -1, 0
