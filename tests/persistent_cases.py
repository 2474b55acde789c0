"""GPU cases of the persistent worker, one per process (test_persistent.py runs each under a
timeout, since a worker that never exits would hold the GPU):
    python tests/persistent_cases.py CASE [--small]
Each case checks its own results and exits 0 only if they hold; --small shrinks a case for
compute-sanitizer."""

from __future__ import annotations

import sys
import threading
from collections import deque
from pathlib import Path

import torch
from errors import expect_error

from jitk.persistent import (
    CHAIN_OPS,
    ITEM_WORDS,
    IntArg,
    Op,
    QueueFullError,
    TensorArg,
    Worker,
    WorkerError,
)

TEST_OPS_FILE = str(Path(__file__).resolve().parent / "csrc" / "persistent_test_ops.cuh")
_I64 = torch.int64
TEST_OPS = (
    Op("record", "persistent_test::Record",
       (TensorArg("hits", _I64, (None,)), TensorArg("order", _I64, (None,)),
        TensorArg("count", _I64, (1,)), IntArg("value"))),
    Op("step", "persistent_test::Step",
       (TensorArg("cell", _I64, (1,)), IntArg("expect"), IntArg("next"))),
    Op("spawn", "persistent_test::Spawn", (TensorArg("cell", _I64, (1,)), IntArg("depth"))),
    Op("orphan", "persistent_test::Orphan",
       (TensorArg("hits", _I64, (None,)), TensorArg("order", _I64, (None,)),
        TensorArg("count", _I64, (1,)))),
    Op("fail", "persistent_test::Fail", (IntArg("code"),)),
    Op("poke", "persistent_test::Poke", (IntArg("address"),)),
    Op("busy", "persistent_test::Busy", (IntArg("ns"),)),
    Op("nothing", "persistent_test::Nothing", (IntArg("unused"),)),
)


def test_worker(**kwargs) -> Worker:
    return Worker("test", [TEST_OPS_FILE], TEST_OPS, **kwargs)


def chain_worker(**kwargs) -> Worker:
    return Worker("chain", ["persistent_chain.cuh"], CHAIN_OPS, cuda_compiler="auto", **kwargs)


def aligned_ring(capacity: int) -> torch.Tensor:
    """A CPU ring of `capacity` empty slots at a 128-byte boundary, as pinned memory has."""
    raw = torch.full((capacity * ITEM_WORDS + 16,), -1, dtype=torch.int64)
    skip = (-raw.data_ptr()) % 128 // 8
    return raw[skip:skip + capacity * ITEM_WORDS].view(capacity, ITEM_WORDS)


class _NeverEnds:
    """Stands in for the worker kernel's end event where no kernel runs."""

    @staticmethod
    def query() -> bool:
        return False


def running_on_host(worker: Worker) -> Worker:
    """`worker` as start() leaves it, its ring and counters in CPU memory and no kernel: the
    host half of the queue (publish, wait) without a GPU. Nothing ever completes."""
    worker.device = torch.device("cpu")
    worker._ring = aligned_ring(worker.capacity).flatten()
    worker._done = torch.full((worker.capacity,), -1, dtype=_I64)
    worker._host_words = torch.zeros(8, dtype=_I64)
    worker._ring_address, worker._done_address, worker._host_words_address = (
        t.data_ptr() for t in (worker._ring, worker._done, worker._host_words))
    worker._keep, worker._next, worker._ended = deque(), 0, _NeverEnds()
    worker._running, worker._stopping = True, False
    return worker


def counters(n: int):
    hits = torch.zeros(n, dtype=_I64, device="cuda")
    order = torch.full((n,), -1, dtype=_I64, device="cuda")
    return hits, order, torch.zeros(1, dtype=_I64, device="cuda")


# ------------------------------------------------------------------------------ cases
def case_exactly_once(small: bool) -> None:
    """4 host threads push at once, single items and batches; each thread's items form a
    chain through its own cell (Step), interleaved with Records that must each run once."""
    threads, rounds = (4, 20) if small else (4, 2500)
    per_thread = 4 * rounds  # Record values a thread uses: one single, a batch of 3 a round
    hits, order, count = counters(threads * per_thread)
    cells = [torch.zeros(1, dtype=_I64, device="cuda") for _ in range(threads)]
    worker = test_worker(capacity=256).start(blocks=8)
    failures = []

    def produce(k: int) -> None:
        try:
            last = None
            for r in range(rounds):
                value = k * per_thread + 4 * r
                last = worker.push("step", cell=cells[k], expect=r, next=r + 1, after=last)
                worker.push("record", hits=hits, order=order, count=count, value=value)
                batch = [("record", dict(hits=hits, order=order, count=count, value=value + i))
                         for i in (1, 2, 3)]
                batch.append(("step", dict(cell=cells[k], expect=r + 1, next=r + 1)))
                last = worker.push_many(batch, after=last, chain=True)[-1]
        except Exception as error:  # noqa: BLE001 - reported below, from the main thread
            failures.append(error)

    pool = [threading.Thread(target=produce, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in pool), "a producer thread hung"
    assert not failures, failures
    worker.stop(timeout=30)
    records = threads * per_thread
    assert count.item() == records, (count.item(), records)
    assert torch.equal(hits.cpu(), torch.ones(records, dtype=_I64)), "an item ran twice or never"
    assert sorted(order.cpu().tolist()) == list(range(records))
    assert [c.item() for c in cells] == [rounds] * threads, "a chain ran out of order"
    print(f"exactly once: {records} records and {2 * threads * rounds} chained steps from "
          f"{threads} threads")


def case_soak(small: bool) -> None:
    """A million Records in prepared batches of 512: none lost, none twice."""
    batch_size, batches = (64, 4) if small else (512, 2000)
    total = batch_size * batches
    hits, _, count = counters(batch_size)
    order = torch.full((total,), -1, dtype=_I64, device="cuda")
    worker = test_worker(capacity=1024).start(blocks=8)
    batch = worker.prepare([("record", dict(hits=hits, order=order, count=count, value=i))
                            for i in range(batch_size)])
    last = None
    for _ in range(batches):
        last = worker.push_many(batch, timeout=30)[-1]
    worker.wait(last, timeout=60)
    worker.stop(timeout=30)
    assert count.item() == total, (count.item(), total)
    assert torch.equal(hits.cpu(), torch.full((batch_size,), batches, dtype=_I64))
    assert torch.equal(torch.bincount(order.cpu(), minlength=batch_size), hits.cpu())
    print(f"soak: {total} items, each of the {batch_size} values run {batches} times")


def chain_items(x, w, bufs, n_ops: int):
    """The benchmark's chain: rmsnorm, scale, add in turn, each reading the previous output."""
    items, src = [], x
    for i in range(n_ops):
        dst = bufs[i % 2]
        if i % 3 == 0:
            items.append(("rmsnorm", dict(x=src, w=w, y=dst, eps=1e-6)))
        elif i % 3 == 1:
            items.append(("scale", dict(x=src, y=dst, factor=1.25)))
        else:
            items.append(("add", dict(x=src, b=x, y=dst)))
        src = dst
    return items, src


def chain_reference(x, w, n_ops: int) -> torch.Tensor:
    """The chain in float32 with each step rounded to bf16, as the kernels store it."""
    y, x32, w32 = x.float(), x.float(), w.float()
    for i in range(n_ops):
        if i % 3 == 0:
            y = y * torch.rsqrt(y.pow(2).mean() + 1e-6) * w32
        elif i % 3 == 1:
            y = y * 1.25
        else:
            y = y + x32
        y = y.bfloat16().float()
    return y


def case_chain(small: bool) -> None:
    """180 chained ops on 4096 bf16 against a reference, on fresh data each round, outputs
    poisoned first. Everything torch runs is run before the worker starts (lazy loading)."""
    n, n_ops = 4096, 30 if small else 180
    rounds = []
    for _ in range(3):
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        bufs = [torch.full_like(x, float("nan")) for _ in range(2)]
        rounds.append((x, w, bufs, chain_reference(x, w, n_ops)))
    relative_error(rounds[0][3], rounds[0][3])
    worker = chain_worker().start(blocks=8)
    outs = []
    for x, w, bufs, _ in rounds:
        items, out = chain_items(x, w, bufs, n_ops)
        worker.wait(worker.push_many(items, chain=True)[-1], timeout=10)
        outs.append(out)
    worker.stop(timeout=10)
    for out, (_, _, _, ref) in zip(outs, rounds):
        err = relative_error(out, ref)
        assert err < 2e-2, err
    print(f"chain: {n_ops} ops on {n} bf16 match the reference (rel. error {err:.1e})")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def case_device_push(small: bool) -> None:
    """An op pushes follow-ups from the GPU: depth 200 leaves the cell at 201."""
    cell = torch.zeros(1, dtype=_I64, device="cuda")
    worker = test_worker().start(blocks=4)
    depth = 20 if small else 200
    worker.wait(worker.push("spawn", cell=cell, depth=depth), timeout=10)
    worker.stop(timeout=10)  # drains the device ring too
    assert cell.item() == depth + 1, cell.item()
    print(f"device push: {depth} follow-ups ran")


def case_stream_wait(small: bool) -> None:
    """Another stream waits for an item with jitk.stream_wait_value on its completion counter,
    then reads what the item wrote. (Not under compute-sanitizer, which runs one kernel at a
    time: the copy behind the wait would wait for the worker.)"""
    from jitk.kernels.wait_value import stream_wait_value
    cell = torch.zeros(1, dtype=_I64, device="cuda")
    out = torch.zeros(1, dtype=_I64, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # load these kernels before the worker is resident
        out.copy_(cell)
        stream_wait_value(torch.zeros(1, dtype=_I64, pin_memory=True), 0, op="geq")
    torch.cuda.synchronize()
    worker = test_worker().start(blocks=4)
    t = worker.push("busy", ns=2_000_000)  # the wait is in place before the step runs
    u = worker.push("step", cell=cell, expect=0, next=7, after=t)
    with torch.cuda.stream(side):
        stream_wait_value(worker.done_flag(u), u, op="geq")
        out.copy_(cell)
    side.synchronize()
    assert out.item() == 7, out.item()
    worker.stop(timeout=10)
    print("stream wait: a stream waited on an item's counter and saw its result")


def case_errors(small: bool) -> None:
    """An op's failure and a dependency timeout surface as WorkerError; stop still returns."""
    worker = test_worker().start(blocks=2)
    t = worker.push("fail", code=42)
    expect_error(lambda: worker.wait(t, timeout=10), "failed with code 42", kind=WorkerError)
    expect_error(lambda: worker.stop(timeout=10), "failed with code 42", kind=WorkerError)
    hits, order, count = counters(1)
    worker = test_worker().start(blocks=2, dependency_timeout=0.05)
    worker.push("orphan", hits=hits, order=order, count=count)
    expect_error(lambda: worker.stop(timeout=10), "longer than dependency_timeout",
                 kind=WorkerError)
    assert count.item() == 0
    print("errors: op failure and dependency timeout raised WorkerError")


def case_stop_timeout(small: bool) -> None:
    """A worker busy past stop()'s timeout: stop raises TimeoutError and returns; a later stop
    succeeds."""
    import time
    worker = test_worker().start(blocks=1)
    worker.push("busy", ns=3_000_000_000)
    start = time.monotonic()
    expect_error(lambda: worker.stop(timeout=0.2), "did not exit", kind=TimeoutError)
    assert time.monotonic() - start < 5
    worker.stop(timeout=10)
    print("stop timeout: raised after the bound, then stopped")


def case_host_bounds(small: bool) -> None:
    """The host's waits end with errors that say what they waited for: the queue's lock held
    by another pusher, a full ring, an item never done (CPU memory; no GPU)."""
    worker = running_on_host(chain_worker(capacity=16))
    x = torch.randn(64).bfloat16()
    batch = worker.prepare([("scale", dict(x=x, y=x, factor=1.0))] * 16)
    with worker._lock:  # another pusher holds the queue
        expect_error(lambda: worker.push_many(batch, timeout=0.1),
                     "another thread held the queue for 0.1 s", kind=QueueFullError)
    worker.push_many(batch)  # fills the ring; nothing ever runs
    expect_error(lambda: worker.push_many(batch, timeout=0.1),
                 "the ring of 16 items had no room for 16 more within 0.1 s",
                 kind=QueueFullError)
    expect_error(lambda: worker.wait(15, timeout=0.1), "item 15 was not done within 0.1 s",
                 kind=TimeoutError)


def case_fault(small: bool) -> None:
    """An op that faults: wait() raises instead of hanging."""
    worker = test_worker().start(blocks=2)
    t = worker.push("poke", address=16)
    message = expect_error(lambda: worker.wait(t, timeout=20), kind=WorkerError)
    print(f"fault: raised WorkerError ({message[:80]})")


def case_refusals(small: bool) -> None:
    """More blocks than fit, and a start inside graph capture, are refused with reasons."""
    worker = test_worker()
    expect_error(lambda: worker.start(blocks=100_000), "cannot all be resident", kind=ValueError)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    refused = None
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        try:
            worker.start(blocks=2)
        except RuntimeError as error:
            refused = error
    assert refused is not None and "graph capture" in str(refused), refused
    # The stream given to start() capturing, while the current stream is not.
    refused, side = None, torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
        with torch.cuda.stream(side):
            try:
                worker.start(blocks=2, stream=stream)
            except RuntimeError as error:
                refused = error
    assert refused is not None and "graph capture" in str(refused), refused
    assert not worker.running
    print("refusals: too many blocks, graph capture on the current or the given stream")


def case_own_stream(small: bool) -> None:
    """Workers started without a stream run on streams no other code is given: none of torch's
    pooled streams (each pool cycled twice), not each other's; `running` says which is up."""
    first, second = test_worker(), chain_worker()
    # torch's pools are made (each cycled twice) before any worker holds the GPU: making a
    # pool's streams waits for running work, and a resident worker never ends.
    torch_streams = {torch.cuda.Stream(priority=p).cuda_stream
                     for p in (0, -1) for _ in range(64)}
    torch_streams |= {torch.cuda.current_stream().cuda_stream,
                      torch.cuda.default_stream().cuda_stream}
    # Each worker's kernel is loaded (a start and stop) before the other holds the GPU: lazy
    # module loading may wait for a running kernel too.
    for worker in (first, second):
        worker.start(blocks=1)
        worker.stop(timeout=5.0)
    first.start(blocks=1)
    second.start(blocks=1)
    try:
        assert first.running and second.running
        ours = {first._stream.cuda_stream, second._stream.cuda_stream}
        assert len(ours) == 2 and not ours & torch_streams, (ours, torch_streams)
    finally:
        first.stop(timeout=5.0)
        second.stop(timeout=5.0)
    assert not first.running and not second.running
    first.start(blocks=1)  # a restart makes a fresh stream
    first.stop(timeout=5.0)
    print(f"own_stream: 2 workers' streams apart from {len(torch_streams)} of torch's")


def case_rmsnorm_bits(small: bool) -> None:
    """The worker's RMSNorm gives a bf16 row jitk.rmsnorm's bits (the order of
    jitk/norm_order.cuh): rows of a multiple of 8 (vectors) and odd ones (an element a slot),
    short and long, up to what the worker's block holds in that order, and one past it."""
    import jitk

    widths = (8, 128, 200, 256, 1000, 2048, 4096, 5120, 7168, 8192, 7, 127, 1001, 4095)
    rows = []
    for n in widths:
        x = torch.randn(n, device="cuda").to(torch.bfloat16)
        w = torch.randn(n, device="cuda").to(torch.bfloat16)
        expected = jitk.rmsnorm(x.view(1, n), w, out=torch.empty(1, n, dtype=x.dtype,
                                                                 device="cuda"), eps=1e-6)
        rows.append((x, w, torch.full_like(x, float("nan")), expected.view(n)))
    long = torch.randn(16384, device="cuda").to(torch.bfloat16)  # past the block: its own order
    long_out, ones = torch.full_like(long, float("nan")), torch.ones_like(long)
    reference = chain_reference(long, ones, 1)
    relative_error(reference, reference)  # everything torch runs, before the worker starts
    items = [("rmsnorm", dict(x=x, w=w, y=y, eps=1e-6)) for x, w, y, _ in rows]
    items.append(("rmsnorm", dict(x=long, w=ones, y=long_out, eps=1e-6)))
    worker = chain_worker().start(blocks=2)
    worker.wait(worker.push_many(items)[-1], timeout=10)
    worker.stop(timeout=10)
    differing = [n for n, (_, _, y, expected) in zip(widths, rows) if not torch.equal(y, expected)]
    assert not differing, f"rows whose bits differ from jitk.rmsnorm's, by width: {differing}"
    assert relative_error(long_out, reference) < 2**-7
    print(f"rmsnorm_bits: {len(widths)} widths bit for bit")


CASES = {name.removeprefix("case_"): fn for name, fn in globals().items()
         if name.startswith("case_")}

if __name__ == "__main__":
    CASES[sys.argv[1]]("--small" in sys.argv[2:])
    # A faulted context fails every later call; a host-only case never made one.
    if sys.argv[1] != "fault" and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    print(f"ok {sys.argv[1]}")
