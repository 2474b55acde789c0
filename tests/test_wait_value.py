"""Stream wait / write value (jitk.kernels.wait_value).

CPU part: the module builds for sm_90 without linking the CUDA driver, and every entry point
refuses a bad flag, value or op with a message that says what is wrong and where. GPU part
(marked): waits hold their stream until a passing value arrives, from another stream, a host
thread or inside a CUDA graph, and the data published before the flag is all there after the
wait; every comparison runs on the driver's stream memory operations and on the spin-kernel
fallback. The deadlock scenarios run in fresh processes: writer first must always be released,
and issue 10's waiter-first order is pinned as the hang it still is (a strict xfail).

A wait that is never released would hold the GPU until the process dies, so every GPU test
runs under `watchdog`, which releases the flag whatever happens."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
import torch
import wait_value_deadlock
from errors import expect_error

from jitk.build.cache import list_entries
from jitk.kernels import wait_value
from jitk.kernels.wait_value import Event, stream_wait_value, stream_write_value
from jitk.runtime import streams

KERNEL_FILE = "wait_value.cuh"
WATCHDOG_S = 30.0  # a passing test releases every wait within a second or two
POLL_S = 20.0


def error_of(fn: Callable[[], object]) -> str:
    with pytest.raises(RuntimeError) as info:
        fn()
    return str(info.value)


# ---------------------------------------------------------------------------------------
# CPU / CI: builds and argument checks.


def built_library() -> Path:
    wait_value._kernels()
    entries = [e for e in list_entries() if e.module == "wait_value"]
    assert entries, "no cache entry for the wait_value module"
    return next(entries[0].path.glob("wait_value.so"))


def test_module_builds_for_sm90_with_the_fallback_kernels():
    kernels = wait_value._kernels()
    assert all(callable(fn) for fn in kernels)
    assert wait_value._kernels() is kernels  # cached: a second call is a dict lookup
    entries = [e for e in list_entries() if e.module == "wait_value"]
    if not torch.cuda.is_available():
        assert any("9.0" in e.archs for e in entries)
    library = built_library().read_bytes()
    assert b"wait_kernel" in library and b"write_kernel" in library


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs binutils' readelf")
def test_module_reaches_the_driver_without_linking_it():
    # A machine without a GPU driver must load the module: nothing may need libcuda.
    dynamic = subprocess.run(["readelf", "--dyn-syms", "--dynamic", "--wide", built_library()],
                             capture_output=True, text=True, check=True).stdout
    needed = [line for line in dynamic.splitlines() if "(NEEDED)" in line]
    assert needed and not any("libcuda.so" in line for line in needed), needed
    # "  4: 0000000000000000  0 FUNC  GLOBAL DEFAULT  UND cudaGetErrorString@libcudart.so.13 (2)"
    undefined = {fields[7].split("@")[0] for fields in map(str.split, dynamic.splitlines())
                 if len(fields) > 7 and fields[6] == "UND"}
    assert "cudaGetDriverEntryPointByVersion" in undefined  # the way to the driver
    assert {name for name in undefined if name.startswith("cu") and
            not name.startswith("cuda")} == set()  # no driver (cu*) call is linked


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a driver")
def test_without_a_driver_no_stream_memory_operations_are_reported():
    assert wait_value._capabilities(0) & wait_value._MEMORY_OPERATIONS == 0


def test_each_fallback_reason_warns_once(monkeypatch):
    monkeypatch.setattr(wait_value, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for path in (2, 2, 5, 3, 2, 3):  # 5: the spin kernel on request, nothing to warn about
            wait_value._note(path)
    messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert len(messages) == 2, messages
    assert "no 64-bit stream memory operations" in messages[0]
    assert "op='nor'" in messages[1]
    assert all("spin kernel" in m for m in messages)


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
@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.uint8])
def test_wrong_dtype_is_refused(entry, dtype):
    message = error_of(lambda: entry(torch.zeros(1, dtype=dtype), 1))
    assert "Tensor match failed for 'flag'" in message
    got = str(dtype).removeprefix("torch.")
    assert f"DType mismatch: expected one of [int32, int64] but got {got}" in message
    assert KERNEL_FILE in message


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_empty_flag_is_refused(dtype):
    message = error_of(lambda: stream_wait_value(torch.zeros(0, dtype=dtype), 1))
    assert "'flag' must hold at least one element" in message
    assert "empty tensor" in message
    assert KERNEL_FILE in message


def test_two_dimensional_flag_is_refused():
    message = error_of(lambda: stream_write_value(torch.zeros(1, 1, dtype=torch.int32), 1))
    assert "Tensor match failed for 'flag'" in message
    assert "Dimension mismatch: expected 1 dims but got 2" in message


@pytest.mark.parametrize(("dtype", "value"), [
    (torch.int32, 2**31), (torch.int32, -(2**31) - 1), (torch.int32, 2**63),
    (torch.int64, 2**63), (torch.int64, -(2**63) - 1)])
@pytest.mark.parametrize("entry", [stream_wait_value, stream_write_value])
def test_value_outside_the_flags_range_is_a_value_error_for_every_width(entry, dtype, value):
    name = str(dtype).removeprefix("torch.")
    expect_error(lambda: entry(torch.zeros(1, dtype=dtype), value),
                 f"value must fit in the {name} flag, got {value} (it holds", kind=ValueError)


@pytest.mark.parametrize("value", [1.0, "1", True, None])
def test_value_that_is_no_int_is_refused(value):
    expect_error(lambda: stream_wait_value(torch.zeros(1, dtype=torch.int32), value),
                 "'value' must be an int, got", repr(value), kind=TypeError)


@pytest.mark.parametrize("op", ["ne", "EQ", ""])
def test_unknown_op_is_refused(op):
    expect_error(lambda: stream_wait_value(torch.zeros(1, dtype=torch.int32), 1, op=op),
                 "op must be one of 'geq', 'eq', 'and', 'nor'", f"got {op!r}", kind=ValueError)


@pytest.mark.parametrize("op", [None, 1])
def test_op_that_is_no_str_is_refused(op):
    expect_error(lambda: stream_wait_value(torch.zeros(1, dtype=torch.int32), 1, op=op),
                 "'op' must be a str", kind=TypeError)


@pytest.mark.parametrize("compare", [-1, 4])
def test_comparison_code_out_of_range_is_refused_by_the_module(compare):
    # The C++ side checks what it is given too, for callers that skip the Python layer.
    flag = torch.zeros(1, dtype=torch.int32)
    expect_error(lambda: wait_value._kernels().wait_device_flag(flag, 1, compare, False),
                 f"op must be a comparison code from 0 to 3, got {compare}", KERNEL_FILE)


def test_event_dtype_is_checked():
    expect_error(lambda: Event(dtype=torch.float32), "torch.int32 or torch.int64",
                 "got torch.float32", kind=ValueError)


@pytest.mark.parametrize(("dtype", "value"), [(torch.int32, -7), (torch.int64, -(2**40) - 7)])
def test_host_flag_access_uses_the_first_element_of_a_view(dtype, value):
    # The host-side store and load behind Event.set/query, on plain memory.
    storage = torch.zeros(4, dtype=dtype)
    view = storage[2:]
    wait_value._kernels().set_host_flag(view, value)
    assert storage.tolist() == [0, 0, value, 0]
    assert wait_value._kernels().read_host_flag(view) == value


def test_host_flag_store_refuses_a_value_its_dtype_cannot_hold():
    flag = torch.zeros(1, dtype=torch.int32)
    expect_error(lambda: wait_value._kernels().set_host_flag(flag, 2**40),
                 f"value must fit in the int32 flag, got {2**40}", KERNEL_FILE)
    assert flag.tolist() == [0]


@pytest.mark.parametrize("device", ["cpu", "meta", torch.device("cpu"), "bogus", 1.5])
def test_event_needs_a_cuda_device(device):
    expect_error(lambda: Event(device), "Event(device=...) must be a CUDA device",
                 f"got {device!r}", "Event(host=True)", kind=ValueError)


def test_cuda_device_resolves_an_index():
    """streams.cuda_device, which Event, Worker and split_sms read device= with."""
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    for given in (None, "cuda", torch.device("cuda")):
        assert streams.cuda_device(given, "x") == torch.device("cuda", current)
    assert streams.cuda_device(1, "x") == streams.cuda_device("cuda:1", "x") == torch.device(
        "cuda", 1)
    for bad in (True, "cpu", 1.5):
        expect_error(lambda b=bad: streams.cuda_device(b, "f(device=...)", "a hint"),
                     f"f(device=...) must be a CUDA device (an index, 'cuda', 'cuda:1'), got "
                     f"{bad!r}; a hint", kind=ValueError)


def test_current_stream_raises_what_is_not_a_missing_gpu(monkeypatch):
    assert streams.current_stream() == (-1, 0) or torch.cuda.is_available()

    def broken(device):
        raise RuntimeError("CUDA error: invalid device ordinal")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", broken, raising=False)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        streams.current_stream(7)


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


def new_flag(where: str, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    if where == "pinned":
        return torch.zeros(1, dtype=dtype, pin_memory=True)
    return torch.zeros(1, dtype=dtype, device="cuda")


@pytest.fixture(params=[False, True], ids=["memory-op", "spin-kernel"])
def spin(request, monkeypatch) -> bool:
    """Runs a test on the driver's stream memory operations and again on the fallback."""
    monkeypatch.setattr(wait_value, "_force_spin", request.param)
    return request.param


@pytest.mark.gpu
def test_this_gpu_runs_every_operation_in_its_front_end():
    can = wait_value._capabilities(torch.cuda.current_device())
    print(f"stream memory operation capabilities: {can:#x}")
    assert can & wait_value._MEMORY_OPERATIONS, "the driver offers no stream memory operations"
    ops = ["eq", "geq", "and"] + (["nor"] if can & wait_value._NOR_WAIT else [])
    dtypes = [torch.int32] + ([torch.int64] if can & wait_value._OPERATIONS_64_BIT else [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        for dtype in dtypes:
            for where in ("cuda", "pinned"):
                flag = new_flag(where, dtype)
                stream_write_value(flag, 1)
                for op in ops:
                    stream_wait_value(flag, 0 if op == "nor" else 1, op=op)  # all pass on 1
    done = torch.cuda.Event()
    done.record()
    assert wait_until(done.query), "a wait that passes at once held the stream"


@pytest.mark.gpu
def test_writer_enqueued_first_never_deadlocks_with_cold_kernels():
    # Each run a fresh process: the waiter's own first kernel loads behind its wait.
    wait_value._kernels()  # build once here, so every run only loads the module
    outcomes = wait_value_deadlock.run_fresh(20, "writer-first", timeout_s=60.0)
    assert outcomes == [wait_value_deadlock.RELEASED] * 20, outcomes


@pytest.mark.gpu
@pytest.mark.xfail(strict=True, reason=(
    "issue 10's order hangs in a fresh process under CUDA's default lazy module loading (H100, "
    "driver 580): the first launch of a kernel not loaded yet waits for the GPU, the pending "
    "wait included, on memory operations and the spin kernel alike, also with "
    "CUDA_MODULE_DATA_LOADING=EAGER. Should it ever pass, the module docstring is stale."))
def test_waiter_enqueued_first_with_cold_writer_kernels_issue_10():
    wait_value._kernels()
    # One run: a hang costs the whole timeout, and every run so far has hung.
    outcomes = wait_value_deadlock.run_fresh(1, "waiter-first", timeout_s=20.0)
    assert outcomes == [wait_value_deadlock.RELEASED], outcomes


@pytest.mark.gpu
@pytest.mark.parametrize("spin", ["0", "1"], ids=["memory-op", "spin-kernel"])
def test_waiter_enqueued_first_is_released_when_cuda_loads_every_kernel_at_start(spin):
    # With CUDA_MODULE_LOADING=EAGER no kernel loads behind the wait; the code loaded at start
    # is readied by jitk's first call, before its wait is pending. Start-up takes seconds.
    wait_value._kernels()
    outcomes = wait_value_deadlock.run_fresh(
        2, "waiter-first", timeout_s=60.0,
        env={"CUDA_MODULE_LOADING": "EAGER", "JITK_WAIT_VALUE_SPIN": spin})
    assert outcomes == [wait_value_deadlock.RELEASED] * 2, outcomes


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["cuda", "pinned"])
def test_consumer_sees_all_data_published_before_the_flag(where, spin):
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
def test_wait_and_write_replay_in_a_cuda_graph(host, spin):
    event = Event(host=host)
    answer = Event(host=True)  # written inside the graph, read by the host
    x = torch.zeros(4096, device="cuda")
    y = torch.zeros_like(x)
    event.wait(0)  # the flag starts at 0, so this passes; it and the copy load the kernels
    answer.record(0)
    y.copy_(x + 1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        event.wait(7)
        y.copy_(x + 1)
        answer.record(7)
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
            answer.set(0)
            with torch.cuda.stream(replay_stream):
                x.fill_(float(round_))
                graph.replay()
                done = torch.cuda.Event()
                done.record()
            time.sleep(0.1)
            assert not done.query(), f"replay {round_} ran past the wait"
            assert answer.query(0), f"replay {round_} wrote its answer before the wait passed"
            set_flag(7)
            assert wait_until(lambda: answer.query(7)), f"replay {round_} never answered"
            # The answer is written after the copy: the copy's result is there already.
            torch.testing.assert_close(y, torch.full_like(x, round_ + 1.0))
            assert wait_until(done.query), f"replay {round_} was never released"
            set_flag(0)  # the same value again next replay: take it back first
        assert not fired.is_set()


# Each case: flag dtype, op, the value waited for, values that must not pass, one that must.
COMPARISON_CASES = {
    "eq int64": (torch.int64, "eq", 2**40 + 5, [2**40 + 4, 5, -(2**40) - 5], 2**40 + 5),
    "geq int32": (torch.int32, "geq", 1000, [0, 999, -5], 1001),
    "geq int32 past wrap-around": (torch.int32, "geq", 2**31 - 2, [2**31 - 3, 0], -(2**31) + 1),
    "geq int64": (torch.int64, "geq", 2**40, [2**40 - 1, -1], 2**41),
    "and int32 mask": (torch.int32, "and", 0b0100, [0b1011, 0], 0b0110),
    "and int64 high bit": (torch.int64, "and", 2**50, [2**50 - 1], 2**50 + 3),
    "nor int32 bit 0 clear": (torch.int32, "nor", ~0b1, [0b1, -1], 0b10),
    "nor int64": (torch.int64, "nor", ~(2**45), [2**45, -1], 2**44),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", COMPARISON_CASES, ids=list(COMPARISON_CASES))
@pytest.mark.parametrize("where", ["cuda", "pinned"])
def test_each_comparison_holds_until_a_passing_value_arrives(case, where, spin):
    dtype, op, value, holding, passing = COMPARISON_CASES[case]
    can = wait_value._capabilities(torch.cuda.current_device())
    flag = new_flag(where, dtype)
    flag.fill_(holding[0])
    x = torch.randn(1 << 12, device="cuda")
    y = torch.zeros_like(x)
    y.copy_(x * 3)  # load the kernels before a wait spins (the fallback)
    y.zero_()
    torch.cuda.synchronize()
    waiter, writer = torch.cuda.Stream(), torch.cuda.Stream()
    expect_warning = not spin and (op == "nor" and not can & wait_value._NOR_WAIT or
                                   dtype == torch.int64 and not can & wait_value._OPERATIONS_64_BIT)
    with watchdog(flag, [passing]) as fired:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore" if expect_warning else "error")
            with torch.cuda.stream(waiter):
                stream_wait_value(flag, value, op=op)
                y.copy_(x * 3)
                done = torch.cuda.Event()
                done.record()
            for held in holding:
                with torch.cuda.stream(writer):
                    stream_write_value(flag, held)
                time.sleep(0.05)
                assert not done.query(), f"{op} {value} passed on {held}"
            with torch.cuda.stream(writer):
                stream_write_value(flag, passing)
        assert wait_until(done.query), f"{op} {value} did not pass on {passing}"
        assert not fired.is_set(), "the watchdog had to release the wait"
    torch.testing.assert_close(y, x * 3)
    assert flag.item() == passing


@pytest.mark.gpu
def test_host_sees_the_data_a_stream_wrote_before_its_flag(spin):
    rounds, numel = 8, 4 << 20  # 16 MB a round
    source = torch.empty(numel, dtype=torch.int32, device="cuda")
    landing = torch.full((numel,), -1, dtype=torch.int32, pin_memory=True)
    written = Event(host=True, dtype=torch.int64)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for round_ in range(1, rounds + 1):
            source.fill_(round_ * 7)
            landing.copy_(source, non_blocking=True)
            written.record(round_)
            # The host reads `landing` between rounds: hold the stream until it has.
            written.wait(-round_)
    try:
        for round_ in range(1, rounds + 1):
            assert wait_until(lambda r=round_: written.query(r)), f"round {round_} never came"
            # Once the flag reads round_, the copy before it is complete in host memory.
            assert torch.all(landing == round_ * 7), f"round {round_}: stale data after the flag"
            written.set(-round_)
    finally:  # never leave a wait behind: answer every round until the stream is done
        deadline = time.monotonic() + WATCHDOG_S
        while not stream.query() and time.monotonic() < deadline:
            for round_ in range(1, rounds + 1):
                written.set(-round_)
                time.sleep(1e-3)
        stream.synchronize()


@pytest.mark.gpu
def test_bad_flags_are_refused_on_a_gpu_machine():
    pageable = error_of(lambda: stream_wait_value(torch.zeros(1, dtype=torch.int32), 1))
    assert "got cpu memory that is not pinned" in pageable
    assert "pin_memory=True" in pageable
    wrong_dtype = error_of(
        lambda: stream_write_value(torch.zeros(1, dtype=torch.float32, device="cuda"), 1))
    assert "Tensor match failed for 'flag'" in wrong_dtype
    assert "expected one of [int32, int64] but got float32" in wrong_dtype
    empty = error_of(lambda: stream_wait_value(torch.zeros(0, dtype=torch.int64, device="cuda")))
    assert "'flag' must hold at least one element" in empty
    with pytest.raises(RuntimeError, match=r"needs Event\(host=True\)"):
        Event().set(1)
    torch.cuda.synchronize()  # nothing was launched, so nothing waits
