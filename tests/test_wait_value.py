"""Stream wait / write value (jitk.wait_value).

CPU part: the module builds for sm_90 and every entry point refuses a bad flag or value with
a message that says what is wrong and where. GPU part (marked): waits hold their stream until
the value arrives, from another stream, a host thread or inside a CUDA graph, and the data
published before the flag is all there after the wait.

A wait that is never released would hold the GPU until the process dies, so every GPU test
runs under `watchdog`, which releases the flag whatever happens."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import pytest
import torch

from jitk import wait_value
from jitk.cache import list_entries
from jitk.wait_value import Event, stream_wait_value, stream_write_value

KERNEL_FILE = "wait_value.cuh"
WATCHDOG_S = 30.0  # a passing test releases every wait within a second or two
POLL_S = 20.0


def error_of(fn: Callable[[], object]) -> str:
    with pytest.raises(RuntimeError) as info:
        fn()
    return str(info.value)


# ---------------------------------------------------------------------------------------
# CPU / CI: builds and argument checks.


def test_module_builds_for_sm90_with_both_kernels():
    kernels = wait_value._kernels()
    assert all(callable(fn) for fn in kernels)
    assert wait_value._kernels() is kernels  # cached: a second call is a dict lookup
    entries = [e for e in list_entries() if e.module == "wait_value"]
    assert entries, "no cache entry for the wait_value module"
    if not torch.cuda.is_available():
        assert any("9.0" in e.archs for e in entries)
    library = next(entries[0].path.glob("wait_value.so")).read_bytes()
    assert b"wait_kernel" in library and b"write_kernel" in library


def test_precompile_configs_load_the_module():
    configs = wait_value.precompile_configs()
    assert [label for label, _ in configs] == ["wait_value"]
    assert configs[0][1]() is wait_value._kernels()


@pytest.mark.parametrize("entry", [stream_wait_value, stream_write_value])
def test_pageable_cpu_flag_is_refused(entry):
    flag = torch.zeros(1, dtype=torch.int32)
    message = error_of(lambda: entry(flag, 1))
    assert "flag must be a cuda tensor or pinned host memory, got cpu" in message
    assert KERNEL_FILE in message


@pytest.mark.parametrize("entry", [stream_wait_value, stream_write_value])
def test_wrong_dtype_is_refused(entry):
    message = error_of(lambda: entry(torch.zeros(1, dtype=torch.int64), 1))
    assert "Tensor match failed for 'flag'" in message
    assert "DType mismatch: expected int32 but got int64" in message
    assert KERNEL_FILE in message


def test_empty_flag_is_refused():
    message = error_of(lambda: stream_wait_value(torch.zeros(0, dtype=torch.int32), 1))
    assert "'flag' must hold at least one int32" in message
    assert "empty tensor" in message
    assert KERNEL_FILE in message


def test_two_dimensional_flag_is_refused():
    message = error_of(lambda: stream_write_value(torch.zeros(1, 1, dtype=torch.int32), 1))
    assert "Tensor match failed for 'flag'" in message
    assert "Dimension mismatch: expected 1 dims but got 2" in message


@pytest.mark.parametrize("value", [2**31, -(2**31) - 1])
def test_value_outside_int32_is_refused(value):
    message = error_of(lambda: stream_wait_value(torch.zeros(1, dtype=torch.int32), value))
    assert f"value must fit in the int32 flag, got {value}" in message
    assert KERNEL_FILE in message


def test_host_flag_access_uses_the_first_element_of_a_view():
    # The host-side store and load behind Event.set/query, on plain memory.
    storage = torch.zeros(4, dtype=torch.int32)
    view = storage[2:]
    wait_value._kernels().set_host_flag(view, -7)
    assert storage.tolist() == [0, 0, -7, 0]
    assert wait_value._kernels().read_host_flag(view) == -7


def test_host_event_takes_no_device():
    with pytest.raises(ValueError, match="no device"):
        Event(0, host=True)


# ---------------------------------------------------------------------------------------
# GPU.


def wait_until(predicate: Callable[[], bool], timeout_s: float = POLL_S) -> bool:
    """Polls instead of synchronizing, so a stuck wait fails the test instead of hanging it."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(1e-4)
    return True


@contextlib.contextmanager
def watchdog(flag: torch.Tensor, values: Iterable[int],
             timeout_s: float = WATCHDOG_S) -> Iterator[threading.Event]:
    """No wait outlives its test. If the body runs longer than timeout_s, a thread writes each
    of `values` to the flag in turn, over and over, so a wait stuck on any of them is released;
    the yielded event is then set and the test must fail on it. On exit the same runs until
    the GPU is idle, so a failed assertion leaves no wait behind. The writes go through
    PyTorch, not through the code under test."""
    values = list(values)
    rescue_stream = torch.cuda.Stream() if flag.is_cuda else None
    if rescue_stream is not None:
        # Load the fill kernel now: a first launch while a wait spins might never start.
        torch.ones(1, dtype=flag.dtype, device=flag.device).fill_(1)
        torch.cuda.synchronize()
    release_now, stop, fired = threading.Event(), threading.Event(), threading.Event()

    def write_each_value() -> None:
        for value in values:
            if rescue_stream is None:
                flag.fill_(value)
            else:
                with torch.cuda.stream(rescue_stream):
                    flag.fill_(value)
            time.sleep(2e-3)

    def guard() -> None:
        if not release_now.wait(timeout_s):
            fired.set()
        while not stop.is_set():
            write_each_value()

    thread = threading.Thread(target=guard, name="wait_value watchdog", daemon=True)
    thread.start()
    try:
        yield fired
    finally:
        release_now.set()
        torch.cuda.synchronize()
        stop.set()
        thread.join()


def new_flag(where: str) -> torch.Tensor:
    if where == "pinned":
        return torch.zeros(1, dtype=torch.int32, pin_memory=True)
    return torch.zeros(1, dtype=torch.int32, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["cuda", "pinned"])
def test_consumer_sees_all_data_published_before_the_flag(where):
    rounds = 6
    buffer = torch.zeros(64 << 20, dtype=torch.int32, device="cuda")  # 256 MB
    flag = new_flag(where)
    mismatches = torch.full((rounds,), -1, dtype=torch.int64, device="cuda")
    # Load every kernel of a round before any wait spins.
    buffer.fill_(1)
    mismatches[0] = (buffer != 1).sum()
    torch.cuda.synchronize()
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    consumed = torch.cuda.Event()
    consumed.record()
    with watchdog(flag, range(1, rounds + 1)) as fired:
        for round_ in range(1, rounds + 1):
            pattern = 1_000_003 * round_  # differs from every earlier round's
            # The producer is enqueued first, so no wait can sit ahead of its release in a
            # hardware queue that two streams happen to share.
            with torch.cuda.stream(producer):
                producer.wait_event(consumed)  # the last round's reads are done
                buffer.fill_(pattern)
                stream_write_value(flag, round_)
            with torch.cuda.stream(consumer):
                stream_wait_value(flag, round_)
                mismatches[round_ - 1] = (buffer != pattern).sum()
                consumed = torch.cuda.Event()
                consumed.record(consumer)
        assert wait_until(consumed.query), "the consumer never finished"
        assert not fired.is_set(), "the watchdog had to release a wait"
    assert mismatches.tolist() == [0] * rounds


@pytest.mark.gpu
def test_host_thread_releases_a_waiting_stream():
    ready = Event(host=True)
    x = torch.randn(1 << 16, device="cuda")
    y = torch.zeros_like(x)
    y.copy_(x * 2)  # load the kernels before a wait spins
    y.zero_()
    torch.cuda.synchronize()
    released = threading.Event()

    def release() -> None:
        released.set()  # before the flag: the GPU may finish before this thread runs on
        ready.set(5)

    stream = torch.cuda.Stream()
    releaser = threading.Timer(1.0, release)
    with watchdog(ready.flag, [5]) as fired:
        with torch.cuda.stream(stream):
            ready.wait(5)
            y.copy_(x * 2)
            done = torch.cuda.Event()
            done.record()
        releaser.start()
        time.sleep(0.2)
        assert not done.query(), "the work behind the wait ran before the flag was set"
        assert wait_until(done.query), "the host's release never reached the stream"
        assert released.is_set(), "the work finished before the host released it"
        assert ready.query(5) and not ready.query(4)
        assert not fired.is_set(), "the watchdog had to release the wait"
    releaser.cancel()
    torch.testing.assert_close(y, x * 2)


@pytest.mark.gpu
def test_gpu_flag_holds_until_another_stream_writes_that_value():
    event = Event()
    x = torch.randn(1 << 16, device="cuda")
    y = torch.zeros_like(x)
    y.copy_(x + 1)  # load the kernels before a wait spins
    y.zero_()
    torch.cuda.synchronize()
    waiter, writer = torch.cuda.Stream(), torch.cuda.Stream()
    with watchdog(event.flag, [2, 3]) as fired:
        with torch.cuda.stream(waiter):
            event.wait(3)
            y.copy_(x + 1)
            done = torch.cuda.Event()
            done.record()
        with torch.cuda.stream(writer):
            event.record(2)  # a flag holds values, it does not count: 2 is not 3
        time.sleep(0.2)
        assert not done.query(), "a wait for 3 passed on 0 or 2"
        with torch.cuda.stream(writer):
            event.record(3)
        assert wait_until(done.query), "the write from the other stream never released the wait"
        assert not fired.is_set(), "the watchdog had to release the wait"
    torch.testing.assert_close(y, x + 1)


@pytest.mark.gpu
def test_a_value_stays_until_overwritten():
    event = Event()
    x = torch.randn(1 << 10, device="cuda")
    y = torch.zeros_like(x)
    with watchdog(event.flag, [4]) as fired:
        event.record(4)
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            event.wait(4)
            event.wait(4)  # waits after the write, however many, pass at once
            y.copy_(x)
            done = torch.cuda.Event()
            done.record()
        assert wait_until(done.query)
        assert not fired.is_set()
    torch.testing.assert_close(y, x)


@pytest.mark.gpu
def test_ping_pong_between_host_and_stream():
    ping, pong = Event(host=True), Event(host=True)
    rounds = 20
    stream = torch.cuda.Stream()
    with watchdog(ping.flag, range(1, rounds + 1)) as fired:
        with torch.cuda.stream(stream):
            for i in range(1, rounds + 1):
                ping.wait(i)
                pong.record(i)
        for i in range(1, rounds + 1):
            assert not pong.query(i), f"round {i} answered before the host asked"
            ping.set(i)
            assert wait_until(lambda i=i: pong.query(i)), f"round {i} got no answer"
        assert not fired.is_set()


@pytest.mark.gpu
@pytest.mark.parametrize("host", [True, False], ids=["pinned", "cuda"])
def test_wait_survives_cuda_graph_capture(host):
    event = Event(host=host)
    x = torch.zeros(4096, device="cuda")
    y = torch.zeros_like(x)
    event.wait(0)  # the flag starts at 0, so this passes; it and the copy load the kernels
    y.copy_(x + 1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        event.wait(7)
        y.copy_(x + 1)
    replay_stream, writer = torch.cuda.Stream(), torch.cuda.Stream()

    def set_flag(value: int) -> None:
        if host:
            event.set(value)
        else:
            with torch.cuda.stream(writer):
                event.record(value)
            writer.synchronize()

    with watchdog(event.flag, [7]) as fired:
        for round_ in range(3):
            with torch.cuda.stream(replay_stream):
                x.fill_(float(round_))
                graph.replay()
                done = torch.cuda.Event()
                done.record()
            time.sleep(0.1)
            assert not done.query(), f"replay {round_} ran past the wait"
            set_flag(7)
            assert wait_until(done.query), f"replay {round_} was never released"
            torch.testing.assert_close(y, torch.full_like(x, round_ + 1.0))
            set_flag(0)  # the same value again next replay: take it back first
        assert not fired.is_set()


@pytest.mark.gpu
def test_bad_flags_are_refused_on_a_gpu_machine():
    pageable = error_of(lambda: stream_wait_value(torch.zeros(1, dtype=torch.int32), 1))
    assert "got cpu memory that is not pinned" in pageable
    assert "pin_memory=True" in pageable
    wrong_dtype = error_of(
        lambda: stream_write_value(torch.zeros(1, dtype=torch.float32, device="cuda"), 1))
    assert "Tensor match failed for 'flag'" in wrong_dtype
    assert "expected int32 but got float32" in wrong_dtype
    empty = error_of(lambda: stream_wait_value(torch.zeros(0, dtype=torch.int32, device="cuda")))
    assert "'flag' must hold at least one int32" in empty
    with pytest.raises(RuntimeError, match=r"needs Event\(host=True\)"):
        Event().set(1)
    torch.cuda.synchronize()  # nothing was launched, so nothing waits
