"""A persistent worker: thread blocks launched once that run work items pushed from the host.

    from jitk.persistent import Worker, Op, TensorArg, IntArg, FloatArg, CHAIN_OPS
    worker = Worker("chain", ["persistent_chain.cuh"], CHAIN_OPS,   # builds once per op table
                    cuda_compiler="auto")                           # NVRTC: two halves
    worker.start(blocks=8)                                          # one launch, 8 SMs
    t = worker.push("scale", x=a, y=b, factor=0.5)                  # returns a ticket
    u = worker.push("add", x=b, b=c, y=d, after=t)                  # runs after item t
    worker.wait(u, timeout=1.0)
    worker.stop(timeout=5.0)

The ops are C++ structs (see <jitk/persistent.cuh>), each declared here as an `Op` with its
arguments in the order of its `Args` struct, one 8-byte word each: a tensor (its data pointer),
an int (int64_t) or a float (double). Every argument is checked on the host before the item
reaches the queue (dtype, device, shape, contiguity), and the worker checks at build time that
each op's `Args` is as large as its declaration. A shape entry is an int (exact size), a str
(a size shared by the item's tensors, e.g. "n"; an IntArg of that name defaults to it) or None.
`cuda_compiler` is load_jit's: "auto" builds op files written in two halves (jitk/nvrtc.cuh;
persistent_chain.cuh is) with NVRTC; the default, "nvcc", builds any op file.

Pushing: `push` and `push_many` write items into a ring in pinned host memory and publish them
with one release (the memory-model notes are in persistent.cuh); no CUDA call is made. Tickets
count from 0 in push order. `after=t` makes an item wait for item t (inside the worker, for at
most `dependency_timeout`); `push_many(..., chain=True)` makes each item wait for the one
before. `prepare()` checks and packs a batch once, for pushing many times. A full ring blocks
the pusher for at most `timeout`, then raises QueueFullError. Ops can push follow-up work from
the GPU (TableContext::push), on a second ring in GPU memory that the host does not track.

Completion: `wait(t)` polls item t's completion counter in pinned memory; `done_flag(t)` is that
counter as a 1-element int64 tensor, so a stream can wait for item t with
`jitk.stream_wait_value(worker.done_flag(t), t, op="geq")`. The counter is released at GPU
scope: what the op wrote to GPU memory is visible to the work that follows on this GPU (other
items, a stream waiting on the counter, a copy the host starts after wait()); an op whose
results the host reads in host memory fences at system scope itself (persistent.cuh).

An op that fails (BlockContext::fail), a dependency that times out, an unknown op or a copy of
items from the host ring that times out (its block then exits) set the worker's error, which
`wait` and `stop` raise as WorkerError; an op that faults kills the CUDA context, which they
raise too (the process then needs a restart, as after any fault).

Nothing hangs: `stop(timeout)` asks the worker to finish what was pushed and exit, then to
abort, and raises TimeoutError if it is still running; every wait has a timeout.

What a resident worker costs other work: its blocks hold `blocks` SMs (one block of 256
threads each, mostly waiting) for as long as it runs, and on the whole GPU any resident kernel
slows a GPU-filling kernel beside it. Started on `jitk.split_sms(8).own`, with the other
kernels on `.rest`, the worker leaves them only the SMs it does not hold (the measured tables:
docs/developer_guide/persistent_kernels.md). A worker started while the GPU is full waits for
SMs like any kernel. Its kernel never ends before stop(): `torch.cuda.synchronize()`, and so
starting a graph capture, waits until it stops (check `running`). And CUDA's lazy module
loading may wait for the GPU's running work when it loads a kernel at its first launch: run
every kernel you will use beside the worker once before `start()`, as the tests and the
benchmark do. `start()` itself loads the worker's kernel first. """

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence

import torch

from jitk.base.errors import ArgumentError, ArgumentTypeError, JitkError
from jitk.build.jit import CUDA_COMPILERS, load_jit
from jitk.kernels.persistent.items import Batch, OpTable
from jitk.kernels.persistent.ops import (
    ARG_WORDS,
    CHAIN_OPS,
    ITEM_WORDS,
    FloatArg,
    IntArg,
    Op,
    TensorArg,
)
from jitk.runtime.streams import cuda_device

__all__ = ["CHAIN_OPS", "FloatArg", "IntArg", "Op", "QueueFullError", "TensorArg", "Worker",
           "WorkerError"]

# persistent_host.cuh's layout(): item bytes, ticket/op/after/args offsets, argument bytes, threads.
LAYOUT = (ITEM_WORDS * 8, 0, 8, 16, 24, ARG_WORDS * 8, 256)
_STATE_HEADER_WORDS = 16
# HostWord and Stop of persistent_queue.cuh.
_STOP, _ERROR, _ERROR_TICKET, _ERROR_DETAIL, _HOST_WORDS = 0, 1, 2, 3, 8
_DRAIN, _ABORT = 1, 2
_ERRORS = {
    1: "item {ticket} names op {detail}, which the worker's table does not have",
    2: "item {ticket} waited for item {detail} longer than dependency_timeout; it did not run",
    3: "an op of item {ticket} found the device ring full for longer than dependency_timeout; "
       "its follow-up (device ticket {detail}) was not pushed",
    4: "the op of item {ticket} failed with code {detail} (BlockContext::fail)",
    5: "the TMA copy of {detail} item(s) from item {ticket} on, from the host ring into a "
       "worker block's shared memory, did not complete within dependency_timeout; that block "
       "stopped (the others may still run those items)",
}
IDLE_POLL_US = 0.256  # start()'s default; measured in benchmarks/bench_persistent.py
_POLL_S = 20e-6  # a waiting host thread's sleep between polls (after a short spin)
_SPIN_NS, _SPINS_BEFORE_SLEEP = 20_000, 50  # wait(): spin this many slices, then sleep


class WorkerError(JitkError, RuntimeError):
    """The worker reported an error (an op failed, a dependency timed out) or faulted."""


class QueueFullError(JitkError, TimeoutError):
    """The ring had no room for the pushed items within the push's timeout."""


_EXPORTS = {"launch": "::launch", "max_blocks": "::max_blocks", "arg_bytes": "::arg_bytes",
            "layout": "jitk::persistent::layout", "publish": "jitk::persistent::publish",
            "load_word": "jitk::persistent::load_word", "poll_done": "jitk::persistent::poll_done",
            "store_word": "jitk::persistent::store_word",
            "create_stream": "jitk::persistent::create_stream",
            "destroy_stream": "jitk::persistent::destroy_stream"}


@functools.cache
def _module(name: str, files: tuple[str, ...], table: str, cuda_compiler: str):
    wrappers = [(e, table + c if c.startswith("::") else c) for e, c in _EXPORTS.items()]
    return load_jit("persistent", name, cuda_files=list(files), cuda_wrappers=wrappers,
                    cuda_compiler=cuda_compiler)


class Worker:
    """A worker over one op table; see the module docstring."""

    def __init__(self, name: str, cuda_files: Sequence[str], ops: Sequence[Op], *,
                 capacity: int = 1024, device: torch.device | str | int = "cuda",
                 cuda_compiler: str = "nvcc") -> None:
        if not isinstance(capacity, int) or capacity < 16 or capacity & (capacity - 1):
            raise ArgumentError(f"capacity must be a power of two >= 16, got {capacity!r}")
        if not isinstance(cuda_compiler, str) or cuda_compiler not in CUDA_COMPILERS:
            raise ArgumentError(f"Worker(cuda_compiler=...): one of {', '.join(CUDA_COMPILERS)}, "
                                f"got {cuda_compiler!r}")
        ops = tuple(ops)
        if not ops or not all(isinstance(op, Op) for op in ops):
            raise ArgumentTypeError("ops must be a non-empty sequence of jitk.persistent.Op")
        self.device = cuda_device(device, "Worker(device=...)")
        self.capacity = capacity
        self._table = OpTable(ops)
        table = f"jitk::persistent::Worker<{', '.join(op.cpp for op in ops)}>"
        self._kernels = _module(name, tuple(map(str, cuda_files)), table, cuda_compiler)
        layout = tuple(self._kernels.layout(i) for i in range(len(LAYOUT)))
        if layout != LAYOUT:
            raise RuntimeError(f"persistent.cuh's item layout {layout} is not persistent.py's "
                               f"{LAYOUT}")
        for index, op in enumerate(ops):
            size = self._kernels.arg_bytes(index)
            if size != 8 * len(op.args):
                raise ArgumentError(f"Op '{op.name}' declares {len(op.args)} arguments "
                                    f"({8 * len(op.args)} bytes), but {op.cpp}::Args is {size} "
                                    "bytes: declare one 8-byte word (pointer, int64_t, double) "
                                    "per argument, in order")
        self._lock = threading.Lock()
        self._running = self._stopping = False
        self._stream, self._own_stream = None, 0

    # ------------------------------------------------------------------ packing
    def prepare(self, items: Iterable[tuple[str, dict]], *, chain: bool = False) -> Batch:
        """Checks and packs (op, {argument: value}) pairs; with chain=True each item waits for
        the one before it."""
        return self._table.prepare(items, chain, self.capacity, self.device)

    # ------------------------------------------------------------------ running
    def start(self, blocks: int = 8, *, dependency_timeout: float = 1.0,
              idle_poll_us: float = IDLE_POLL_US,
              stream: torch.cuda.Stream | None = None) -> Worker:
        """Launches `blocks` worker blocks (one SM each) on a stream of their own: `stream`,
        which the worker then holds until it stops (a green context's stream keeps the worker
        on that context's SMs), or one the worker creates with the CUDA runtime and destroys
        once stopped (not one of torch's pooled streams, which other code may be handed).
        `idle_poll_us` bounds an idle block's sleep between looks for new work (each a PCIe
        read of the ring): longer costs the GPU's other kernels less and a new item more
        latency.

        Until stop(), the worker's kernel does not end, so whatever waits for all of the
        device's work waits for it: `torch.cuda.synchronize()` (and `torch.cuda.graph(...)`,
        which synchronizes before capturing) blocks until the worker stops. Wait for streams
        or events instead, and check `running` before synchronizing. Starting is refused
        while the current stream, or `stream`, is capturing a CUDA graph."""
        if self._running:
            raise RuntimeError("this worker is already running; stop() it first")
        if not isinstance(blocks, int) or blocks < 1:
            raise ArgumentError(f"blocks must be an int >= 1, got {blocks!r}")
        if not 0 < dependency_timeout <= 3600:
            raise ArgumentError(f"dependency_timeout must be in (0, 3600] seconds, got "
                                f"{dependency_timeout!r}")
        if not 0.032 <= idle_poll_us <= 1000:
            raise ArgumentError(f"idle_poll_us must be in [0.032, 1000], got {idle_poll_us!r}")
        if stream is not None and (not isinstance(stream, torch.cuda.Stream)
                                   or stream.device != self.device):
            raise ArgumentError(f"stream must be a torch.cuda.Stream on the worker's device "
                                f"{self.device}, got {stream!r}")
        if _capturing(stream):
            raise RuntimeError("a worker cannot start inside CUDA graph capture: it would be "
                               "captured as a node that never finishes, not launched")
        limit = self._kernels.max_blocks(self.device.index)  # also loads the kernel
        if blocks > limit:
            raise ArgumentError(f"blocks={blocks} cannot all be resident at once on "
                                f"{self.device}: it holds at most {limit} worker blocks (256 "
                                "threads each); blocks that never start would leave items waiting")
        cap = self.capacity
        self._ring = torch.full((cap * ITEM_WORDS,), -1, dtype=torch.int64, pin_memory=True)
        self._done = torch.full((cap,), -1, dtype=torch.int64, pin_memory=True)
        self._done_address = self._done.data_ptr()
        self._ring_address = self._ring.data_ptr()
        self._host_words = torch.zeros(_HOST_WORDS, dtype=torch.int64, pin_memory=True)
        self._host_words_address = self._host_words.data_ptr()
        state = torch.full((_STATE_HEADER_WORDS + (2 + ITEM_WORDS) * cap,), -1,
                           dtype=torch.int64, device=self.device)
        state[:_STATE_HEADER_WORDS] = 0
        self._state = state
        self._keep: deque[tuple[int, Batch]] = deque()
        self._next = 0
        self._stream, self._own_stream = self._open_stream(stream)
        try:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # state's init
            self._ended = torch.cuda.Event()
            self._kernels.launch(self._ring, self._done, self._host_words, state, blocks,
                                 int(dependency_timeout * 1e9), round(idle_poll_us * 1e3),
                                 self._stream.cuda_stream)
            self._ended.record(self._stream)
        except BaseException:
            self._close_stream()
            raise
        self._running, self._stopping = True, False
        return self

    def _open_stream(self, stream: torch.cuda.Stream | None) -> tuple[torch.cuda.Stream, int]:
        """The stream to launch on and the handle of the one the worker made (0 if given)."""
        if stream is not None:
            return stream, 0
        handle = self._kernels.create_stream(self.device.index)
        return torch.cuda.ExternalStream(handle, device=self.device), handle

    def _close_stream(self) -> None:
        """Destroys the worker's own stream; call only once its kernel has ended."""
        if self._own_stream:
            self._kernels.destroy_stream(self._own_stream)
        self._stream, self._own_stream = None, 0

    @property
    def running(self) -> bool:
        """Whether the worker was started and not yet stopped: while it is, its kernel does not
        end, and `torch.cuda.synchronize()` would wait until it stops."""
        return self._running

    def push(self, op: str, *, after: int | None = None, timeout: float = 10.0,
             **args: object) -> int:
        """Checks and enqueues one item; returns its ticket."""
        self._require_running("push")
        tensors: list[torch.Tensor] = []
        batch = Batch.of(self._table.pack(op, args, -1, tensors, self.device), tensors)
        return self._publish(batch, after, timeout)[0]

    def push_many(self, items: Batch | Iterable[tuple[str, dict]], *, after: int | None = None,
                  chain: bool = False, timeout: float = 10.0) -> range:
        """Enqueues a batch (prepared, or (op, args) pairs) with one release; returns its
        tickets. `after` is the first item's dependency."""
        self._require_running("push")
        batch = items if isinstance(items, Batch) else self.prepare(items, chain=chain)
        return self._publish(batch, after, timeout)

    def _publish(self, batch: Batch, after: int | None, timeout: float) -> range:
        deadline = time.monotonic() + timeout
        # An untimed try first: a timed acquire costs more, and the lock is free almost always.
        if not (self._lock.acquire(blocking=False) or self._lock.acquire(timeout=timeout)):
            raise QueueFullError(f"another thread held the queue for {timeout} s")
        try:
            if self._stopping:
                raise RuntimeError("cannot push: the worker is stopping")
            first = self._next
            if after is not None and not (isinstance(after, int) and 0 <= after < first):
                raise ArgumentError(f"after must be the ticket of an item already pushed (0 to "
                                    f"{first - 1}), got {after!r}")
            while not self._kernels.publish(self._ring_address, self._done_address,
                                            self.capacity, batch.address, batch.count, first,
                                            -1 if after is None else after):
                self.raise_if_failed()
                if time.monotonic() > deadline:
                    raise QueueFullError(f"the ring of {self.capacity} items had no room for "
                                         f"{batch.count} more within {timeout} s")
                time.sleep(_POLL_S)
            self._keep_until_reused(first, batch)
            self._next = first + batch.count
        finally:
            self._lock.release()
        return range(first, first + batch.count)

    def _keep_until_reused(self, first: int, batch: Batch) -> None:
        """Holds the batch (its tensors) alive while any of its items may still run. publish()
        found every ticket before first + count - capacity done (it checks each slot it
        reuses; earlier pushes checked the rest), so batches that end before it are let go."""
        self._keep.append((first + batch.count - 1, batch))
        done_before = first + batch.count - self.capacity
        while self._keep[0][0] < done_before:
            self._keep.popleft()

    def done_flag(self, ticket: int) -> torch.Tensor:
        """Item `ticket`'s completion counter (pinned int64, 1 element): it is >= ticket once
        the item is done, for jitk.stream_wait_value(flag, ticket, op="geq")."""
        slot = self._slot_of(ticket)
        return self._done[slot:slot + 1]

    def wait(self, ticket: int, timeout: float = 10.0) -> None:
        """Returns once item `ticket` is done; raises WorkerError if the worker reported an
        error or stopped first, TimeoutError after `timeout` seconds."""
        slot = self._slot_of(ticket)
        deadline = time.monotonic() + timeout
        counter, error = self._done_address + 8 * slot, self._host_words_address + 8 * _ERROR
        spins = 0
        # Spins in C++ (which sees the counter change sooner than a Python loop of loads) in
        # bounded slices, then sleeps between looks.
        while (state := self._kernels.poll_done(counter, ticket, error, _SPIN_NS)) == 0:
            spins += 1
            if self._has_ended():
                raise WorkerError(f"the worker stopped before item {ticket} ran")
            if time.monotonic() > deadline:
                raise TimeoutError(f"item {ticket} was not done within {timeout} s")
            if spins > _SPINS_BEFORE_SLEEP:
                time.sleep(_POLL_S)
        if state < 0:
            self.raise_if_failed()

    def raise_if_failed(self) -> None:
        """Raises WorkerError if the worker has recorded an error."""
        code = self._kernels.load_word(self._host_words_address + 8 * _ERROR)
        if code:
            ticket = self._host_words[_ERROR_TICKET].item()
            detail = self._host_words[_ERROR_DETAIL].item()
            message = _ERRORS.get(code, "unknown error code {code} (item {ticket}, detail "
                                        "{detail})")
            raise WorkerError("persistent worker: " + message.format(code=code, ticket=ticket,
                                                                     detail=detail))

    def stop(self, timeout: float = 10.0) -> None:
        """Lets the worker finish every item pushed, then exit; aborts it (items left unrun)
        if that takes over `timeout`. Raises TimeoutError if it is still running after another
        second, WorkerError if it failed."""
        if not self._running:
            return
        # Under the pushers' lock: every item pushed before the drain order is published before
        # it, and none after. A pusher stuck on a full ring holds the lock at most its timeout.
        locked = self._lock.acquire(timeout=timeout)
        self._stopping = True
        if locked:
            self._lock.release()
        self._kernels.store_word(self._host_words, _STOP, _DRAIN)
        try:
            if not self._wait_ended(timeout):
                self._kernels.store_word(self._host_words, _STOP, _ABORT)
                if not self._wait_ended(1.0):
                    raise TimeoutError(f"the worker did not exit within {timeout} + 1 s (an op "
                                       "still running?); call stop() again later: its blocks "
                                       "hold their SMs until it exits")
                self._running = False
                self._close_stream()
                self.raise_if_failed()  # an error recorded on the way explains the wait better
                raise TimeoutError(f"the worker did not finish its items within {timeout} s "
                                   "and was aborted; items pushed may not have run")
        except WorkerError:
            self._running = False
            raise
        self._running = False
        self._close_stream()
        self.raise_if_failed()

    def _has_ended(self) -> bool:
        try:
            return self._ended.query()
        except RuntimeError as fault:  # the query reports a faulted kernel
            raise WorkerError(f"the worker faulted: {fault}") from fault

    def _wait_ended(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._has_ended():
            if time.monotonic() > deadline:
                return False
            time.sleep(1e-4)
        return True

    def _slot_of(self, ticket: int) -> int:
        self._require_running("wait")
        if not isinstance(ticket, int) or not 0 <= ticket < self._next:
            raise ArgumentError(f"ticket must be one that was pushed (0 to {self._next - 1}), got "
                                f"{ticket!r}")
        return ticket % self.capacity

    def _require_running(self, what: str) -> None:
        if not self._running:
            raise RuntimeError(f"cannot {what}: the worker is not running (start() it)")

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _capturing(stream: torch.cuda.Stream | None) -> bool:
    """Whether the current stream, or `stream`, is capturing a CUDA graph."""
    if torch.cuda.is_current_stream_capturing():
        return True
    if stream is None:
        return False
    with torch.cuda.stream(stream):
        return torch.cuda.is_current_stream_capturing()
