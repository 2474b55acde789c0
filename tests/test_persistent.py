"""The persistent worker (jitk.persistent, <jitk/persistent.cuh>).

CPU part: the worker builds for sm_90, its item layout agrees between C++ and Python, an op
whose Args does not fit is refused at compile time and one whose declaration disagrees with its
Args at load time, every argument is checked on the host with a message naming it, a worker
that is not running refuses pushes, and each of the worker's error codes raises its own
message. GPU part (marked): each case of persistent_cases.py runs in a fresh process under a
timeout, since a worker that never exits holds the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import persistent_cases
import pytest
import torch
from errors import expect_error

from jitk.base.errors import ArgumentError, ArgumentTypeError
from jitk.build import nvrtc
from jitk.build.jit import JitCompileError
from jitk.persistent import (
    CHAIN_OPS,
    ITEM_WORDS,
    LAYOUT,
    IntArg,
    Op,
    QueueFullError,
    TensorArg,
    Worker,
    WorkerError,
)

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def worker() -> Worker:
    return persistent_cases.test_worker()


@pytest.fixture(scope="module")
def chain() -> Worker:
    return persistent_cases.chain_worker()


@pytest.fixture(scope="module")
def host_chain() -> Worker:
    """A chain worker that takes CPU tensors as its own (CI has no GPU): the device check is
    the one check this moves."""
    worker = persistent_cases.chain_worker()
    worker.device = torch.device("cpu")
    return worker


def rows(n: int = 64, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(n).to(dtype)


# ------------------------------------------------------------------------------ build, layout
def test_layout_agrees(worker, chain):
    # The constructor compares the module's layout() with LAYOUT; this pins LAYOUT itself.
    assert LAYOUT == (128, 0, 8, 16, 24, 96, 256)
    assert [worker._kernels.layout(i) for i in range(len(LAYOUT))] == list(LAYOUT)
    expect_error(lambda: worker._kernels.layout(len(LAYOUT)), "layout field must be 0 to 6")
    assert [chain._kernels.arg_bytes(i) for i in range(3)] == [40, 32, 32]


def test_packed_item_words(host_chain):
    x, w, y = rows(), rows(), rows()
    batch = host_chain.prepare([("rmsnorm", dict(x=x, w=w, y=y, eps=0.5)),
                           ("scale", dict(x=y, y=x, factor=2.0))], chain=True)
    words = batch.words.view(2, ITEM_WORDS).tolist()
    assert words[0][:8] == [0, 0, -1, x.data_ptr(), w.data_ptr(), y.data_ptr(), 64,
                            4602678819172646912]  # 0.5 as a double's bits
    assert words[1][1:3] == [1, 0]  # op 1, after item 0 of the batch
    assert batch.count == 2 and batch.tensors == [x, w, y, y, x]


def test_publish_copies_items_behind_tickets(host_chain):
    """The host half of the queue on CPU memory: items land in their slots with absolute
    dependencies and tickets; a slot whose previous item is not done refuses the batch."""
    x = rows()
    batch = host_chain.prepare([("scale", dict(x=x, y=x, factor=2.0))] * 3, chain=True)
    ring, done = persistent_cases.aligned_ring(16), torch.full((16,), -1, dtype=torch.int64)
    done[0] = 0  # item 0 ran: ticket 16 may take its slot
    publish = host_chain._kernels.publish
    assert publish(ring.data_ptr(), done.data_ptr(), 16, batch.address, 3, 14, 9) == 1
    slots = ring.tolist()
    assert [slots[s][:3] for s in (14, 15, 0)] == [[14, 1, 9], [15, 1, 14], [16, 1, 15]]
    assert slots[14][3:5] == [x.data_ptr(), x.data_ptr()] and slots[1][0] == -1
    # Tickets 30..32 reuse slots 14, 15, 0, whose items 14..16 are done only up to 15.
    done[14], done[15] = 14, 15
    assert publish(ring.data_ptr(), done.data_ptr(), 16, batch.address, 3, 30, -1) == 0
    assert ring[14, 0].item() == 14  # nothing written
    done[0] = 16
    assert publish(ring.data_ptr(), done.data_ptr(), 16, batch.address, 3, 30, -1) == 1
    assert ring[14, :3].tolist() == [30, 1, -1] and ring[0, :3].tolist() == [32, 1, 31]
    expect_error(lambda: publish(ring.data_ptr() + 8, done.data_ptr(), 16, batch.address, 3,
                                 0, -1), "'ring' must be a non-null, aligned host address")
    expect_error(lambda: publish(ring.data_ptr(), done.data_ptr(), 16, batch.address, 17, 0,
                                 -1), "a batch of 17 items does not fit a ring of 16")


def test_poll_done_on_host_words(chain):
    """wait()'s spin: done once the counter reaches the ticket, an error as soon as the error
    word is set, neither within the spin's bound otherwise."""
    counter, error = torch.tensor([4], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    poll = chain._kernels.poll_done
    assert poll(counter.data_ptr(), 5, error.data_ptr(), 10_000) == 0
    assert poll(counter.data_ptr(), 4, error.data_ptr(), 0) == 1
    error[0] = 2
    assert poll(counter.data_ptr(), 4, error.data_ptr(), 0) == -1
    expect_error(lambda: poll(counter.data_ptr(), 4, error.data_ptr(), -1),
                 "spin_ns must be 0 to 1e9, got -1")


def test_args_too_large_refused_at_compile_time():
    too_big = Op("too_big", "TooBig", tuple(IntArg(f"a{i}") for i in range(12)))
    expect_error(lambda: Worker("too_big", [str(HERE / "csrc" / "persistent_too_big.cuh")],
                                [too_big]),
                 "must fit the item's 96 argument bytes", kind=JitCompileError)


def test_declaration_must_match_args():
    short = Op("scale", "jitk::persistent::chain::Scale",
               (TensorArg("x", torch.bfloat16, ("n",)), IntArg("n")))
    expect_error(lambda: Worker("chain", ["persistent_chain.cuh"], [short]),
                 "declares 2 arguments (16 bytes), but jitk::persistent::chain::Scale::Args is "
                 "32 bytes", kind=ArgumentError)


def test_the_chain_ops_build_in_two_halves_for_the_fleet(tmp_path, monkeypatch):
    """persistent_chain.cuh is written in two halves: NVRTC builds its worker kernel for each
    target from sm_90 on, which its TMA copies need (nvcc builds the same file in
    test_declaration_must_match_args)."""
    try:
        nvrtc.version()
    except nvrtc.NvrtcError as error:
        pytest.skip(f"no NVRTC here: {error}")
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("JITK_CUDA_ARCH", "9.0;10.0;12.0")
    Worker("fleet_chain", ["persistent_chain.cuh"], CHAIN_OPS, cuda_compiler="nvrtc")
    (names,) = tmp_path.glob("*/*.kernels")
    ops = ", ".join(op.cpp for op in CHAIN_OPS)
    assert names.read_text().split("\t")[0] == f"&jitk::persistent::worker_kernel<{ops}>"
    cubins = {path.name.split(".")[-2] for path in names.parent.glob("*.cubin")}
    assert cubins == {"sm_90", "sm_100", "sm_120"}


# ------------------------------------------------------------------------------ host checks
@pytest.mark.parametrize("item, kind, fragments", [
    (("nope", {}), ArgumentError, ["unknown op 'nope'", "rmsnorm, scale, add"]),
    (("scale", dict(x=rows(), y=rows(), factor=1.0, z=1)), ArgumentTypeError,
     ["unexpected argument(s) ['z']"]),
    (("scale", dict(x=rows(dtype=torch.float32), y=rows(), factor=1.0)), ArgumentTypeError,
     ["scale: 'x' must be torch.bfloat16, got torch.float32"]),
    (("scale", dict(x=rows().view(8, 8), y=rows(), factor=1.0)), ArgumentError,
     ["'x' must have 1 dimension(s) ('n',), got shape (8, 8)"]),
    (("add", dict(x=rows(64), b=rows(32), y=rows(64))), ArgumentError,
     ["add: 'b' dimension 0: expected 'n' = 64 (bound by an earlier tensor), got 32"]),
    (("scale", dict(x=rows(128)[::2], y=rows(), factor=1.0)), ArgumentError,
     ["'x' must be contiguous"]),
    (("scale", dict(y=rows(), factor=1.0)), ArgumentTypeError,
     ["'x' must be a tensor, got NoneType"]),
    (("scale", dict(x=rows(), y=rows(), factor="2")), ArgumentTypeError,
     ["'factor' must be a float, got str"]),
    (("scale", dict(x=rows(), y=rows(), n=65, factor=1.0)), ArgumentError,
     ["'n' = 65 but the tensors' 'n' is 64"]),
    (("scale", dict(x=rows(), y=rows(), n=True, factor=1.0)), ArgumentTypeError,
     ["'n' must be an int, got bool"]),
])
def test_arguments_checked_on_host(host_chain, item, kind, fragments):
    expect_error(lambda: host_chain.prepare([item]), *fragments, kind=kind)


def test_device_checked_on_host(chain):
    expect_error(lambda: chain.prepare([("scale", dict(x=rows(), y=rows(), factor=1.0))]),
                 f"scale: 'x' must be on the worker's device {chain.device}, got cpu",
                 kind=ArgumentError)


def test_batch_checks(host_chain):
    expect_error(lambda: host_chain.prepare([]), "no items to push", kind=ArgumentError)
    expect_error(lambda: host_chain.prepare(["scale"]), "item 0: expected (op_name, {argument: "
                 "value})", kind=ArgumentTypeError)
    small = Worker("chain", ["persistent_chain.cuh"], CHAIN_OPS, capacity=16)
    small.device = torch.device("cpu")
    x = rows()
    expect_error(lambda: small.prepare([("scale", dict(x=x, y=x, factor=1.0))] * 17),
                 "17 items do not fit the ring of 16", kind=ArgumentError)


def test_construction_refusals():
    expect_error(lambda: Worker("chain", ["persistent_chain.cuh"], CHAIN_OPS, capacity=100),
                 "capacity must be a power of two >= 16, got 100", kind=ArgumentError)
    expect_error(lambda: Worker("chain", ["persistent_chain.cuh"], CHAIN_OPS, device="cpu"),
                 "Worker(device=...) must be a CUDA device", "got 'cpu'", kind=ValueError)
    expect_error(lambda: Worker("chain", ["persistent_chain.cuh"], []),
                 "ops must be a non-empty sequence", kind=ArgumentTypeError)
    for compiler in ("clang", ["nvcc"]):  # named as Worker's, before any build
        expect_error(lambda c=compiler: Worker("chain", ["persistent_chain.cuh"], CHAIN_OPS,
                                               cuda_compiler=c),
                     "Worker(cuda_compiler=...): one of nvcc, nvrtc, auto", repr(compiler),
                     kind=ArgumentError)
    expect_error(lambda: Op("x", "X", (IntArg("a"), IntArg("a"))), "argument names repeat",
                 kind=ArgumentError)


@pytest.mark.parametrize("name", ["after", "timeout", "op", "chain", "items", "self"])
def test_op_refuses_names_push_takes(name):
    """push(op, after=, timeout=, **args) would take such an argument as its own."""
    expect_error(lambda: Op("wait_for", "W", (IntArg("n"), IntArg(name))),
                 f"Op 'wait_for': argument '{name}' has a name push() takes", kind=ArgumentError)


def test_tensor_arg_dtype_must_be_a_torch_dtype():
    expect_error(lambda: TensorArg("x", "bf16", ("n",)),
                 "TensorArg 'x': dtype must be a torch.dtype", "got 'bf16'",
                 kind=ArgumentTypeError)
    assert TensorArg("x", torch.bfloat16, ("n",)).dtype is torch.bfloat16


def test_not_running_refusals(chain):
    x = rows()
    expect_error(lambda: chain.push("scale", x=x, y=x, factor=1.0),
                 "cannot push: the worker is not running", kind=RuntimeError)
    expect_error(lambda: chain.wait(0), "cannot wait: the worker is not running")
    chain.stop()  # a worker never started stops at once
    expect_error(lambda: chain.start(blocks=0), "blocks must be an int >= 1, got 0",
                 kind=ArgumentError)
    expect_error(lambda: chain.start(dependency_timeout=0), "dependency_timeout must be in",
                 kind=ArgumentError)
    expect_error(lambda: chain.start(stream="side"), "stream must be a torch.cuda.Stream",
                 kind=ArgumentError)
    for idle_poll_us in (0, 0.01, 2000):
        expect_error(lambda v=idle_poll_us: chain.start(idle_poll_us=v),
                     "idle_poll_us must be in [0.032, 1000]", kind=ArgumentError)
    assert issubclass(QueueFullError, TimeoutError)


@pytest.mark.parametrize("code, ticket, detail, message", [
    (1, 3, 9, "item 3 names op 9, which the worker's table does not have"),
    (2, 3, 1, "item 3 waited for item 1 longer than dependency_timeout; it did not run"),
    (3, 3, 7, "an op of item 3 found the device ring full for longer than dependency_timeout; "
              "its follow-up (device ticket 7) was not pushed"),
    (4, 3, 42, "the op of item 3 failed with code 42 (BlockContext::fail)"),
    (5, 16, 180, "the TMA copy of 180 item(s) from item 16 on, from the host ring into a worker "
                 "block's shared memory, did not complete within dependency_timeout; that block "
                 "stopped (the others may still run those items)"),
    (99, 3, 7, "unknown error code 99 (item 3, detail 7)"),
])
def test_error_codes_raise_their_messages(code, ticket, detail, message):
    """The worker's error words (persistent.cuh's Error, its ticket and detail) as the host
    raises them: each code of the latch with its own message."""
    worker = persistent_cases.running_on_host(persistent_cases.chain_worker(capacity=16))
    worker._host_words[1:4] = torch.tensor([code, ticket, detail])  # kError, ticket, detail
    got = expect_error(worker.raise_if_failed, kind=WorkerError)
    assert got == "jitk: persistent worker: " + message


class _StreamKernels:
    """The worker's module, but recording the streams it is asked to make and destroy."""

    def __init__(self, kernels) -> None:
        self._kernels, self.calls = kernels, []

    def __getattr__(self, name: str):
        return getattr(self._kernels, name)

    def create_stream(self, device: int) -> int:
        self.calls.append(("create", device))
        return 0x5EED

    def destroy_stream(self, handle: int) -> None:
        self.calls.append(("destroy", handle))


def test_own_stream_is_made_by_cuda_and_destroyed_once_ended(monkeypatch):
    """Without stream=, the worker's stream comes from its module (cudaStreamCreate), never
    from torch's pool of shared streams; stop() destroys it only once the kernel has ended."""
    worker = persistent_cases.running_on_host(persistent_cases.chain_worker(capacity=16))
    kernels = _StreamKernels(worker._kernels)
    monkeypatch.setattr(worker, "_kernels", kernels)
    monkeypatch.setattr(worker, "device", torch.device("cuda", 0))

    def pooled(*args, **kwargs):
        raise AssertionError("the worker took a stream from torch's pool")

    wrapped = []
    monkeypatch.setattr(torch.cuda, "Stream", pooled)
    monkeypatch.setattr(torch.cuda, "ExternalStream",
                        lambda handle, device: wrapped.append((handle, device)) or "ext")
    worker._stream, worker._own_stream = worker._open_stream(None)
    assert kernels.calls == [("create", 0)] and wrapped == [(0x5EED, worker.device)]
    assert worker._stream == "ext" and worker.running
    # The kernel has not ended: stop() gives up, and the stream must outlive it.
    expect_error(lambda: worker.stop(timeout=0.01), "did not exit", kind=TimeoutError)
    assert kernels.calls == [("create", 0)]
    worker._ended = type("Ended", (), {"query": staticmethod(lambda: True)})
    worker.stop()
    assert kernels.calls == [("create", 0), ("destroy", 0x5EED)] and not worker.running
    given = object()
    assert worker._open_stream(given) == (given, 0)  # a caller's stream is theirs to destroy
    worker._stream, worker._own_stream = given, 0
    worker._close_stream()
    assert len(kernels.calls) == 2


# ------------------------------------------------------------------------------ GPU
def run_case(name: str, timeout_s: float = 90) -> str:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, str(HERE / "persistent_cases.py"), name],
                          capture_output=True, text=True, timeout=timeout_s, env=env)
    assert done.returncode == 0, f"case {name} failed:\n{done.stdout}\n{done.stderr[-3000:]}"
    assert f"ok {name}" in done.stdout
    return done.stdout


def test_host_waits_end_with_their_errors():
    """A held queue lock, a full ring and an item never done: each wait of the host's raises
    after its timeout (CPU memory, no GPU), in a subprocess in case one never ends."""
    run_case("host_bounds", timeout_s=120)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["exactly_once", "soak", "chain", "device_push",
                                  "stream_wait", "errors", "own_stream",
                                  "stop_timeout", "fault", "refusals", "rmsnorm_bits"])
def test_gpu_case(name):
    run_case(name)
