"""Stream-ordered flags: hold a CUDA stream until a 32-bit flag holds a value, or set it.

    stream_write_value(flag, 3)   # on the producer's stream, after its work
    stream_wait_value(flag, 3)    # on the consumer's stream, before its work

Both enqueue a one-thread kernel on PyTorch's current stream and return at once; they are
CUDA-graph capturable. The wait reads the flag with acquire semantics and the write stores it
with release semantics, both at system scope: everything that happened before the write on
the writer's stream (or, for a host flag, before the host stored it) is visible to the work
enqueued after the wait.

A flag is a 1-d int32 tensor of at least one element, of which the first is used. It lives on
the GPU, or in pinned host memory (`pin_memory=True`) where a host thread can set it and
several GPUs can share it. A wait on a GPU flag runs on the current stream of the flag's
device; a wait on a host flag runs on the current stream of the current device.

A flag holds a value, it does not count: the wait passes once it *reads* the value it waits
for. So a wait enqueued after the flag got its value passes at once (the value stays until
something overwrites it), and a wait that reads the flag only after it has moved on to another
value keeps waiting until the value comes back. Reuse a flag by giving every round its own
value (a round counter) rather than toggling between two. A wait that is never satisfied holds
its stream, and its slot on the GPU, until the process ends.

CUDA loads a kernel at its first launch (lazily), and loading may wait for the GPU to go
idle. This module loads its own kernels up front; a kernel of yours launched for the first
time while a wait spins may block the launching thread until the wait is released, which
never happens if that thread was to release it: run such work once before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from .custom_op import op
from .jit import load_jit

__all__ = ["Event", "precompile_configs", "stream_wait_value", "stream_write_value"]

_NAMESPACE = "jitk::wait_value"


class _Kernels(NamedTuple):
    wait_device_flag: Callable
    write_device_flag: Callable
    wait_host_flag: Callable
    write_host_flag: Callable
    set_host_flag: Callable
    read_host_flag: Callable


@functools.cache
def _kernels() -> _Kernels:
    module = load_jit(
        "wait_value",
        cuda_files=["wait_value.cuh"],
        cuda_wrappers=[(name, f"{_NAMESPACE}::{name}") for name in _Kernels._fields],
    )
    # Fetched once: a module attribute lookup goes through the FFI each time.
    return _Kernels(*(getattr(module, name) for name in _Kernels._fields))


def _current_stream() -> tuple[int, int]:
    """(device index, cudaStream_t) of PyTorch's current stream. tvm-ffi hands a kernel that
    stream only when a cuda tensor is an argument, which a host flag is not."""
    try:
        stream = torch.cuda.current_stream()
    except (AssertionError, RuntimeError):
        # PyTorch without CUDA: the kernel's own checks then say what is wrong with the flag.
        return -1, 0
    return stream.device_index, stream.cuda_stream


@op("jitk::stream_wait_value", mutates_args=(),  # reads the flag; kept as a side effect
    tags=(torch.Tag.cudagraph_unsafe,))  # the flag must be the caller's, not a graph's copy
def stream_wait_value(flag: torch.Tensor, value: int = 1) -> None:
    """Hold the current stream until flag[0] == value (an int32)."""
    if flag.is_cuda:
        _kernels().wait_device_flag(flag, value)
    else:
        _kernels().wait_host_flag(flag, value, *_current_stream())


@op("jitk::stream_write_value", mutates_args=("flag",),
    tags=(torch.Tag.cudagraph_unsafe,))  # the flag must be the caller's, not a graph's copy
def stream_write_value(flag: torch.Tensor, value: int = 1) -> None:
    """Set flag[0] = value once everything before it on the current stream is done."""
    if flag.is_cuda:
        _kernels().write_device_flag(flag, value)
    else:
        _kernels().write_host_flag(flag, value, *_current_stream())


class Event:
    """A flag of its own with record/wait, like torch.cuda.Event but value-based and able to
    be set by a host thread or captured in a CUDA graph on either side.

        done = Event()           # flag in GPU memory of the current device
        done.record(step)        # on the producer's stream
        done.wait(step)          # on the consumer's stream

        ready = Event(host=True) # flag in pinned host memory
        ready.wait(1)            # the stream holds ...
        ready.set(1)             # ... until a host thread says so

    The flag starts at 0. Values follow the module's rules: a flag holds the last value
    written, so give each round its own value, or set the flag back before reusing one.
    """

    def __init__(self, device: torch.device | str | int | None = None, *,
                 host: bool = False) -> None:
        if host:
            if device is not None:
                raise ValueError("Event(host=True) lives in pinned host memory; a wait runs "
                                 "on the current device, so no device is given")
            self.flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        else:
            device = "cuda" if device is None else device
            self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.host = host

    def record(self, value: int = 1) -> None:
        """Set the flag to `value` once the current stream's earlier work is done."""
        stream_write_value(self.flag, value)

    def wait(self, value: int = 1) -> None:
        """Hold the current stream until the flag holds `value`."""
        stream_wait_value(self.flag, value)

    def set(self, value: int) -> None:
        """Set a host flag from the host, now, with a release store: what this thread wrote
        before is visible to the work after the waits it releases."""
        self._require_host("set")
        _kernels().set_host_flag(self.flag, value)

    def query(self, value: int = 1) -> bool:
        """Whether a host flag holds `value` now (after a record, say), without blocking.
        The read is an acquire: once True, what the GPU wrote before the record is visible."""
        self._require_host("query")
        return _kernels().read_host_flag(self.flag) == value

    def _require_host(self, method: str) -> None:
        if not self.host:
            raise RuntimeError(f"Event.{method}() reads or writes the flag from the host, so it "
                               "needs Event(host=True); this flag is in GPU memory")


def precompile_configs() -> list[tuple[str, Callable[[], object]]]:
    """The one module this family builds: it has no template parameters."""
    return [("wait_value", _kernels)]
