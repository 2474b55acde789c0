"""Stream-ordered flags: hold a CUDA stream until a flag passes a comparison, or set the flag.

    stream_write_value(flag, 3)   # on the producer's stream, after its work
    stream_wait_value(flag, 3)    # on the consumer's stream, before its work

Both enqueue one of the CUDA driver's stream memory operations (cuStreamWaitValue32/64,
cuStreamWriteValue32/64) on PyTorch's current stream and return at once. The GPU's front end
holds the stream: no kernel runs, no SM is taken, nothing is loaded. CUDA graph capture records
them as nodes, so a captured wait or write waits or writes at every replay.

A flag is a 1-d int32 or int64 tensor of at least one element, of which the first is used.
It lives on the GPU, or in pinned host memory (`pin_memory=True`) where a host thread can set
it and several GPUs can share it. A wait on a GPU flag runs on the current stream of the
flag's device; a wait on a host flag runs on the current stream of the current device.

The comparison (`op`) is one the hardware runs, as the driver defines it (CU_STREAM_WAIT_VALUE_*):
  "eq"   flag == value
  "geq"  (flag - value) >= 0 in the flag's signed width: flag is at or past value, and a
         counter that wraps around keeps working (within half its range)
  "and"  (flag & value) != 0: some bit of the mask `value` is set
  "nor"  ~(flag | value) != 0: some bit is 0 in both; with value = ~mask, some bit of mask is
         clear. There is no not-equal.
`value` is given in the flag's signed range (a mask of all ones is -1).

What a write makes visible, and to whom. The driver puts a system-scope memory barrier before
the write, for the writer's stream: every store of the work enqueued before it on that stream
(to its GPU's memory, to another GPU's, to pinned host memory) is performed before the flag
changes. So once a wait passes on the value written,
- work after the wait on any stream of the same GPU sees those stores;
- work after the wait on another GPU sees them (through a pinned host flag, or a GPU flag
  that GPU reaches by peer access);
- a host thread that sees the value with `Event.query` (an acquire load) sees those stores to
  pinned host memory.
The barrier has no narrower scope to offer, even where every waiter is on the writer's GPU:
the driver's v2 API (CUDA 12+) refuses a write without it (CU_STREAM_WRITE_VALUE_NO_MEMORY_
BARRIER: CUDA_ERROR_INVALID_VALUE), and a GPU-scope barrier batched before the write adds to
it rather than replacing it.
`Event.set` is a release store: what the setting host thread wrote before (to pinned memory)
is visible to the work after the waits it releases. Stores that other devices (an RDMA NIC)
put into a GPU's memory are ordered for the waiter by CU_STREAM_WAIT_VALUE_FLUSH, which the
wait adds where the GPU offers it (CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES; the H100s
measured do not, so there such stores need the device's own ordering).

Speed. A wake-up through a stream memory operation is a little slower than a
torch.cuda.Event record/wait and faster than the spin kernel. A flag stored by a kernel rather
than by stream_write_value wakes a waiting stream later: the front end notices a store from an
SM only when it reads the flag again. Behind a kernel, the front end lets the kernel finish
before it reads the flag. Figures: docs/developer_guide/debugging_and_performance.md,
"Stream wait / write value".

A flag holds a value, it does not count: a wait passes once it *reads* a value that passes.
So a wait enqueued after the flag got its value passes at once (the value stays until
something overwrites it), and a wait that reads the flag only after it has moved on keeps
waiting until a passing value comes back. Reuse a flag by giving every round its own value (a
round counter, waited on with "geq") rather than toggling between two.

A wait that is never satisfied holds its stream until the process ends. The driver warns
that the order these operations set up is invisible to CUDA's scheduler, which may serialize
other work behind a wait in an order that deadlocks; enqueuing the write before the wait is
the order that never depends on it.

Enqueue the writer before the waiter, or run the writer's kernels once first. CUDA loads a
kernel's code at its first launch (lazy loading, its default), and that loading waits for
the work already on the GPU: a pending wait included, so a write enqueued behind such a
launch never comes. Tried on an H100 (driver 580, torch 2.11) in fresh processes, the waiter
enqueued first, then a producer stream's first _sleep, fill_ and write; the same on stream
memory operations and on the spin kernel:
- lazy loading (the default): the host thread blocks in the first launch of a kernel whose
  module is not loaded yet; it hung in every run. CUDA_MODULE_DATA_LOADING=EAGER, NVIDIA's
  advice for this pattern, changed nothing (also when set in the process before CUDA starts),
  nor did one kernel of jitk's or an unrelated torch kernel run before the wait. A kernel
  whose module was loaded but not the kernel itself: the launch returns, yet none of the
  process's work runs on the GPU any more, not even a copy on a third stream.
- CUDA_MODULE_LOADING=EAGER: released in every run (6 of 6 on memory operations, 6 of 6 on
  the spin kernel). There the first kernel launch of the process readies all the code, so
  jitk's first memory operation on a device launches an empty kernel before its wait can be
  pending (without it, memory operations hung: 0 of 1, no work of the process ran). EAGER
  costs every process start-up time and GPU memory (docs/developer_guide/
  debugging_and_performance.md), so jitk does not set it.
Writer first, then the waiter with a kernel of its own that loads behind the wait, was
released in every run (20 of 20), and once the writer's kernels had run in the process,
waiter-first worked in every test.

Fallback. Where the driver has no stream memory operations, or the GPU lacks the 64-bit ones
or the "nor" wait (its device attributes say so), the call enqueues a one-thread kernel that
spins on the flag (or writes it) instead, with the same comparisons and the same release/
acquire visibility at system scope, and warns once. That kernel occupies an SM while it
waits. JITK_WAIT_VALUE_SPIN=1 asks for the fallback everywhere.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from jitk.base import settings
from jitk.build.jit import load_jit
from jitk.runtime.op import op
from jitk.runtime.streams import cuda_device, current_stream

__all__ = ["Event", "precompile_configs", "stream_wait_value", "stream_write_value"]

_NAMESPACE = "jitk::wait_value"

# The driver's numbering (CU_STREAM_WAIT_VALUE_*), which wait_value.cuh passes on as it is.
COMPARISONS = {"geq": 0, "eq": 1, "and": 2, "nor": 3}

# Capability bits of _capabilities() (wait_value.cuh).
_MEMORY_OPERATIONS, _OPERATIONS_64_BIT, _NOR_WAIT, _FLUSH_REMOTE_WRITES = 2, 4, 8, 16

# Why a call fell back to the spin kernel (the Path codes of wait_value.cuh).
_FALLBACK_REASONS = {
    1: "the CUDA driver offers no stream memory operations (it predates CUDA 12.0)",
    2: "this GPU has no 64-bit stream memory operations "
       "(CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS is 0)",
    3: "this GPU cannot run op='nor' waits in its front end "
       "(CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR is 0)",
    4: "the CUDA driver refused a stream memory operation (CUDA_ERROR_NOT_SUPPORTED)",
}
_warned: set[int] = set()

# Tests set this to run the fallback on a GPU that does not need it.
_force_spin = settings.flag("JITK_WAIT_VALUE_SPIN")

# A flag's values, by its dtype; a flag of another dtype is refused by the C++ checks.
_BITS = {torch.int32: 32, torch.int64: 64}


class _Kernels(NamedTuple):
    wait_device_flag: Callable
    write_device_flag: Callable
    wait_host_flag: Callable
    write_host_flag: Callable
    set_host_flag: Callable
    read_host_flag: Callable
    stream_memory_operations: Callable


@functools.cache
def _kernels() -> _Kernels:
    module = load_jit(
        "wait_value",
        cuda_files=["wait_value.cuh"], cuda_compiler="auto",
        cuda_wrappers=[(name, f"{_NAMESPACE}::{name}") for name in _Kernels._fields],
    )
    # Fetched once: a module attribute lookup goes through the FFI each time.
    return _Kernels(*(getattr(module, name) for name in _Kernels._fields))


def _check_value(flag: torch.Tensor, value: int) -> None:
    """A value that is no int, or one the flag's dtype cannot hold: refused here, with one
    error type for every width."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"value must be an int, got {type(value).__name__}")
    limit = 1 << (_BITS.get(flag.dtype, 64) - 1)
    if not -limit <= value < limit:
        dtype = str(flag.dtype).removeprefix("torch.")
        raise ValueError(f"value must fit in the {dtype} flag, got {value} (it holds "
                         f"{-limit} to {limit - 1}; a mask of all ones is -1)")


def _compare_code(op: str) -> int:
    try:
        return COMPARISONS[op]
    except (KeyError, TypeError):
        raise ValueError(f"op must be one of {', '.join(map(repr, COMPARISONS))}, "
                         f"got {op!r}") from None


def _note(path: int) -> None:
    """Warns once per reason when a call had to use the spin kernel."""
    if path in _FALLBACK_REASONS and path not in _warned:
        _warned.add(path)
        reason = _FALLBACK_REASONS[path]
        warnings.warn(f"jitk.stream_wait_value: {reason}, so waits and writes use a spin "
                      "kernel, which holds an SM while it waits; see the module docstring "
                      "(Fallback)", RuntimeWarning, stacklevel=3)


# References: the host does what the front end would, so they cannot be captured in a CUDA
# graph, and a wait holds the calling thread (up to REFERENCE_WAIT_S) rather than the stream.
# The write waits for the stream's earlier work, then stores; the wait polls the flag until
# it passes, and only then does the caller enqueue what follows.
REFERENCE_WAIT_S = 30.0


def _passes(flag_value: int, value: int, op: str, bits: int) -> bool:
    def signed(v: int) -> int:
        v &= (1 << bits) - 1
        return v - (1 << bits) if v >> (bits - 1) else v

    if op == "geq":
        return signed(flag_value - value) >= 0
    if op == "eq":
        return signed(flag_value) == signed(value)
    if op == "and":
        return signed(flag_value & value) != 0
    return signed(~(flag_value | value)) != 0


def _wait_reference(flag: torch.Tensor, value: int = 1, op: str = "eq") -> None:
    _compare_code(op)
    _check_value(flag, value)
    bits = flag.element_size() * 8
    deadline = time.monotonic() + REFERENCE_WAIT_S
    while not _passes(int(flag[0]), value, op, bits):  # a GPU flag's read waits for the stream
        if time.monotonic() > deadline:
            raise TimeoutError(f"stream_wait_value reference: flag[0] did not pass {op!r} "
                               f"against {value} within {REFERENCE_WAIT_S:.0f} s")
        time.sleep(1e-4)


def _write_reference(flag: torch.Tensor, value: int = 1) -> None:
    _check_value(flag, value)
    if not flag.is_cuda and torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()  # the stream's earlier work comes first
    flag[0] = value


def _flag_cases(write: bool) -> list:
    """Flags of both widths on the GPU and pinned on the host; for waits, every comparison
    with a value the flag passes already (a parity check must not hang)."""
    from jitk.tools.testing import Case

    # (op, flag's value, value compared)
    passing = (("eq", 7, 7), ("geq", 5, 3), ("geq", -(2**31), 2**31 - 1), ("and", 6, 2),
               ("nor", 0, -2))
    cases = []
    for dtype, where in ((torch.int32, "gpu"), (torch.int64, "gpu"), (torch.int32, "host")):
        def flag(device, start, dtype=dtype, where=where):
            made = torch.tensor([start, 11], dtype=dtype, device=device if where == "gpu"
                                else "cpu")
            return made.pin_memory() if where == "host" and device.type == "cuda" else made

        name = f"{str(dtype).removeprefix('torch.')} on the {where}"
        if write:
            cases.append(Case(f"{name}, write -5", lambda device, flag=flag: (
                (flag(device, 3), -5), {})))
            continue
        for compare, start, value in passing:
            if dtype == torch.int64 and compare == "geq" and start < 0:
                start = -(2**63)  # the wrap-around case at the int64 edge
                value = 2**63 - 1
            cases.append(Case(f"{name}, {compare} {value}", lambda device, flag=flag,
                              start=start, value=value, compare=compare: (
                                  (flag(device, start), value, compare), {})))
    return cases


@op("jitk::stream_wait_value", mutates_args=(),  # reads the flag; kept as a side effect
    reference=_wait_reference, cases=lambda: _flag_cases(False),
    tags=(torch.Tag.cudagraph_unsafe,))  # the flag must be the caller's, not a graph's copy
def stream_wait_value(flag: torch.Tensor, value: int = 1, op: str = "eq") -> None:
    """Hold the current stream until flag[0] passes `op` against `value` (see the module)."""
    compare = _compare_code(op)
    _check_value(flag, value)
    if flag.is_cuda:
        path = _kernels().wait_device_flag(flag, value, compare, _force_spin)
    else:
        path = _kernels().wait_host_flag(flag, value, compare, *current_stream(), _force_spin)
    if path:
        _note(path)


@op("jitk::stream_write_value", mutates_args=("flag",), reference=_write_reference,
    cases=lambda: _flag_cases(True),
    tags=(torch.Tag.cudagraph_unsafe,))  # the flag must be the caller's, not a graph's copy
def stream_write_value(flag: torch.Tensor, value: int = 1) -> None:
    """Set flag[0] = value once everything before it on the current stream is done."""
    _check_value(flag, value)
    if flag.is_cuda:
        path = _kernels().write_device_flag(flag, value, _force_spin)
    else:
        path = _kernels().write_host_flag(flag, value, *current_stream(), _force_spin)
    if path:
        _note(path)


def _capabilities(device: int) -> int:
    """The capability bits (_MEMORY_OPERATIONS, ...) of a GPU's front end, as the driver
    reports them: for tests and benchmarks."""
    return _kernels().stream_memory_operations(device)


class Event:
    """A flag of its own with record/wait, like torch.cuda.Event but value-based and able to
    be set by a host thread or captured in a CUDA graph on either side.

        done = Event()           # flag in GPU memory of the current device
        done.record(step)        # on the producer's stream
        done.wait(step)          # on the consumer's stream (or wait(step, op="geq"))

        ready = Event(host=True) # flag in pinned host memory
        ready.wait(1)            # the stream holds ...
        ready.set(1)             # ... until a host thread says so

    The flag starts at 0, as an int32 or (dtype=torch.int64) an int64. Values follow the
    module's rules: a flag holds the last value written, so give each round its own value, or
    set the flag back before reusing one.
    """

    def __init__(self, device: torch.device | str | int | None = None, *,
                 host: bool = False, dtype: torch.dtype = torch.int32) -> None:
        if dtype not in (torch.int32, torch.int64):
            raise ValueError(f"Event(dtype=...) must be torch.int32 or torch.int64, got {dtype}")
        if host:
            if device is not None:
                raise ValueError("Event(host=True) lives in pinned host memory; a wait runs "
                                 "on the current device, so no device is given")
            self.flag = torch.zeros(1, dtype=dtype, pin_memory=True)
        else:
            self.flag = torch.zeros(1, dtype=dtype, device=cuda_device(
                device, "Event(device=...)", "for a flag in host memory use Event(host=True)"))
        self.host = host

    def record(self, value: int = 1) -> None:
        """Set the flag to `value` once the current stream's earlier work is done."""
        stream_write_value(self.flag, value)

    def wait(self, value: int = 1, op: str = "eq") -> None:
        """Hold the current stream until the flag passes `op` against `value`."""
        stream_wait_value(self.flag, value, op)

    def set(self, value: int) -> None:
        """Set a host flag from the host, now, with a release store: what this thread wrote
        before is visible to the work after the waits it releases."""
        self._require_host("set")
        _check_value(self.flag, value)
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
