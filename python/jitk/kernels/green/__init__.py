"""Disjoint SM partitions of one GPU, each with a stream: a persistent worker on a few SMs and
ordinary kernels on the rest, neither able to take the other's SMs.

    split = jitk.split_sms(8)                  # 8 SMs (the driver's granularity on sm_90)
    worker.start(blocks=8, stream=split.own)   # the worker's blocks on those 8
    with torch.cuda.stream(split.rest):        # everything else on the other 124
        y = model(x)
    split.close()                              # once nothing runs on either stream

Both partitions are CUDA green contexts made from one split of the device's SMs. Contexts
made one at a time, as `torch.cuda.green_contexts.GreenContext.create(num_sms)` makes them,
each take their SMs from the whole device, so a context of 8 and one of 124 share SMs; these
never do. Kernels enqueued on other streams (the primary context's) may still run on any SM.
The streams are `torch.cuda.ExternalStream`s: torch and jitk kernels, events and graph capture
work on them as on any stream."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from jitk.build.jit import load_jit
from jitk.runtime.streams import cuda_device

__all__ = ["SmSplit", "precompile_configs", "split_sms"]

_NAMESPACE = "jitk::green"
_ENTRY_POINTS = ("split", "destroy", "record_sm_ids")
_OWN_STREAM, _REST_STREAM, _OWN_CONTEXT, _REST_CONTEXT, _OWN_SMS, _REST_SMS, _HANDLES = range(7)


@functools.cache
def _module():
    return load_jit("green_context", cuda_files=["green_context.cuh"], cuda_compiler="auto",
                    cuda_wrappers=[(name, f"{_NAMESPACE}::{name}") for name in _ENTRY_POINTS])


@dataclass
class SmSplit:
    """Two disjoint SM partitions of `device`: `own` (own_sms SMs) and `rest` (rest_sms)."""
    device: torch.device
    own: torch.cuda.ExternalStream
    rest: torch.cuda.ExternalStream
    own_sms: int
    rest_sms: int
    _handles: torch.Tensor = field(repr=False)

    def close(self) -> None:
        """Destroys both streams and contexts; call it once nothing runs on either (a worker
        started on `own` stopped first): the streams are invalid afterwards. A second call
        does nothing. Without it they live until the process ends."""
        _module().destroy(self._handles)

    def __enter__(self) -> SmSplit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def split_sms(sms: int, device: torch.device | str | int | None = None) -> SmSplit:
    """Splits `device`'s SMs (default: the current CUDA device) into a partition of at least
    `sms` SMs and one of the rest, each with a stream. The driver rounds `sms` up to its
    granularity (8 on sm_90); `own_sms` says how many it gave. Raises RuntimeError where the
    driver has no green-context streams (CUDA < 12.5), no GPU is visible or the rest would be
    empty."""
    if not isinstance(sms, int) or isinstance(sms, bool) or sms < 1:
        raise ValueError(f"sms must be an int >= 1, got {sms!r}")
    device = cuda_device(device, "split_sms(device=...)")
    if not torch.cuda.is_available():
        raise RuntimeError("split_sms splits a GPU's SMs, and PyTorch sees no GPU")
    handles = torch.zeros(_HANDLES, dtype=torch.int64)
    _module().split(device.index, sms, handles)
    h = handles.tolist()
    return SmSplit(device, torch.cuda.ExternalStream(h[_OWN_STREAM], device=device),
                   torch.cuda.ExternalStream(h[_REST_STREAM], device=device),
                   h[_OWN_SMS], h[_REST_SMS], handles)


def sm_ids(blocks: int, stream: torch.cuda.Stream, spin_cycles: int = 200_000) -> list[int]:
    """The SM each of `blocks` one-warp blocks ran on, launched on `stream` (each spins
    `spin_cycles` first, so that they spread over every SM the stream may use)."""
    out = torch.full((blocks,), -1, dtype=torch.int32, device=stream.device)
    stream.wait_stream(torch.cuda.current_stream(stream.device))  # the fill above
    _module().record_sm_ids(out, spin_cycles, stream.cuda_stream)
    stream.synchronize()
    return out.tolist()


def precompile_configs() -> list[tuple[str, Callable[[], object]]]:
    """The one module this family builds: it has no template parameters."""
    return [("green_context", _module)]
