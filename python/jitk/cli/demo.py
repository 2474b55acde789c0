"""python -m jitk demo: the main job in one command.

With a GPU: each shipped kernel runs once against a reference, with its time and GB/s.
Without one: the host side is built for sm_90, a validation error is shown exactly as a user
would see it, and the demo says what it skipped. It exits 1, naming what failed, when a
build fails or a result does not match its reference."""

from __future__ import annotations

import os
import sys
import time

import torch

from jitk.build import toolchain
from jitk.build.jit import JitCacheMissError, JitCompileError
from jitk.build.lock import JitLockError
from jitk.kernels import hicache, norm, wait_value
from jitk.tools.timing import median_us

# What keeps a kernel from being built or loaded, as opposed to the validation error the
# demo shows on purpose.
BUILD_ERRORS = (JitCompileError, JitCacheMissError, JitLockError, toolchain.ToolchainError)


def _report(name: str, check: str, us: float | None = None, moved_bytes: int = 0) -> None:
    timing = f"{us:8.1f} us  {moved_bytes / us / 1e3:7.1f} GB/s" if us else ""
    print(f"  {name:<42} {check:<20} {timing}")


def _rmsnorm_on_gpu() -> bool:
    x = torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(8192, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    norm.rmsnorm(x, weight, out=out)
    reference = torch.nn.functional.rms_norm(x.float(), (8192,), weight.float(), eps=1e-6)
    error = ((out.float() - reference).norm() / reference.norm()).item()
    us = median_us(lambda: norm.rmsnorm(x, weight, out=out))
    _report("rmsnorm bf16 4096x8192", f"rel. error {error:.1e}", us, 2 * x.nbytes)
    return error < 1e-2


def _hicache_on_gpu() -> bool:
    tokens, row = 4096, 512  # bf16 rows of 1 KiB
    k_gpu, v_gpu = (torch.randn(2 * tokens, row, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))
    k_host, v_host = (torch.full((2 * tokens, row), float("nan"), dtype=torch.bfloat16)
                      .pin_memory() for _ in range(2))
    src = torch.randperm(2 * tokens, device="cuda")[:tokens]
    dst = torch.randperm(2 * tokens, device="cuda")[:tokens]
    offload = lambda: hicache.transfer_hicache_one_layer(k_host, v_host, dst, k_gpu, v_gpu, src)
    offload()
    torch.cuda.synchronize()
    exact = torch.equal(k_host[dst.cpu()], k_gpu[src].cpu()) and torch.equal(
        v_host[dst.cpu()], v_gpu[src].cpu())
    us = median_us(offload)
    _report("hicache GPU -> pinned host, 4096 x 1 KiB", "exact" if exact else "MISMATCH",
            us, 2 * tokens * row * 2)
    return exact


def _wait_value_on_gpu() -> bool:
    data = torch.empty(1 << 26, device="cuda", dtype=torch.int32)
    seen = torch.empty((), device="cuda", dtype=torch.int64)
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    event = wait_value.Event()

    def produce(value: int) -> None:
        data.fill_(value)
        event.record(1)

    def consume() -> None:
        event.wait(1)
        torch.sum(data, dim=0, dtype=torch.int64, out=seen)

    # Every kernel runs once before a wait spins: CUDA loads a kernel at its first launch,
    # and a load can wait for the GPU to go idle, which it never does while a wait spins.
    produce(2)
    consume()
    event.record(0)
    torch.cuda.synchronize()
    with torch.cuda.stream(consumer):  # waits for the producer enqueued after it
        consume()
    with torch.cuda.stream(producer):
        produce(3)
    torch.cuda.synchronize()
    # Wake-up latency needs two streams timed together: benchmarks/bench_wait_value.py.
    saw_all = seen.item() == 3 * data.numel()
    _report("wait_value: producer -> consumer stream",
            "consumer saw all" if saw_all else "MISMATCH")
    return saw_all


def _without_gpu() -> list[str]:
    setting = os.environ.get(toolchain.ARCH_ENV) or "9.0"
    os.environ[toolchain.ARCH_ENV] = setting
    try:
        archs = ", ".join(toolchain.sm_name(a) for a in toolchain.parse_archs(setting))
    except toolchain.ToolchainError as error:
        print(f"No CUDA GPU is visible, and there is nothing to build for: {error}")
        return [toolchain.ARCH_ENV]
    print(f"No CUDA GPU is visible: building for {archs} ({toolchain.ARCH_ENV}) to show the "
          "host side.")
    started = time.perf_counter()
    x = torch.randn(4, 4096, dtype=torch.bfloat16)
    weight = torch.randn(4096, dtype=torch.bfloat16)
    try:
        norm.rmsnorm(x, weight)
    except BUILD_ERRORS as error:
        print(f"  FAILED: the rmsnorm module was not built:\n\n    {error}\n")
        return ["building rmsnorm"]
    except RuntimeError as error:
        print(f"  rmsnorm module ready in {time.perf_counter() - started:.1f} s; calling it with "
              "CPU tensors raises, as a user would see it:\n")
        print(f"    RuntimeError: {error}\n")
    else:
        print("  FAILED: rmsnorm accepted CPU tensors; it should have refused them\n")
        return ["rmsnorm's device check"]
    print("Skipped (they need a GPU): running rmsnorm, fused_add_rmsnorm, the HiCache "
          "transfers and stream wait/write value, and their timings.")
    return []


def _on_gpu() -> list[str]:
    failed = []
    for name, check in (("rmsnorm", _rmsnorm_on_gpu), ("hicache", _hicache_on_gpu),
                        ("wait_value", _wait_value_on_gpu)):
        try:
            ok = check()
        except BUILD_ERRORS as error:
            print(f"  {name}: FAILED: {error}")
            ok = False
        if not ok:
            failed.append(name)
    return failed


def main() -> int:
    import tvm_ffi

    gpu = toolchain.current_gpu_capability()
    print(f"jitk demo: torch {torch.__version__}, apache-tvm-ffi {tvm_ffi.__version__}, "
          f"CUDA toolkit {toolchain.cuda_home()}")
    if gpu is None:
        failed = _without_gpu()
    else:
        print(f"GPU: {torch.cuda.get_device_name()} (sm_{gpu[0]}{gpu[1]}); first calls compile "
              "(cached afterwards)\n")
        failed = _on_gpu()
    if failed:
        print(f"jitk demo: FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
