"""`python -m jitk demo`, the README's first command, on both kinds of machine."""

import os
import re
import subprocess
import sys

import pytest
import torch


def run_demo(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jitk", "demo"], capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=300)


def run_demo_ok() -> subprocess.CompletedProcess:
    result = run_demo()
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU demo is tested below")
def test_demo_without_gpu_builds_shows_an_error_and_says_what_it_skipped():
    out = run_demo_ok().stdout
    assert "No CUDA GPU is visible: building for sm_90" in out
    assert ("RuntimeError: Tensor match failed for 'input' Tensor<4, 4096>[strides=<4096, 1>, "
            "dtype=bfloat16, device=cpu] at rmsnorm.cuh:") in out
    assert "Root cause: Device mismatch: expected cuda but got cpu" in out
    assert "Skipped (they need a GPU)" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU decides the architecture")
@pytest.mark.parametrize("arch, reason", [
    ("7.0", "the installed nvcc (.*) cannot build for sm_70; it supports compute capabilities"),
    ("garbage", "JITK_CUDA_ARCH='garbage' is not a list of compute capabilities"),
])
def test_demo_exits_1_saying_what_failed_when_nothing_can_be_built(arch, reason):
    result = run_demo(JITK_CUDA_ARCH=arch)
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(reason, result.stdout), result.stdout
    assert "ready" not in result.stdout
    assert "jitk demo: FAILED" in result.stderr


@pytest.mark.gpu
def test_demo_on_gpu_runs_every_kernel_against_its_reference():
    out = run_demo_ok().stdout
    assert "MISMATCH" not in out
    for line in ("rmsnorm bf16 4096x8192", "hicache GPU -> pinned host", "wait_value"):
        assert line in out
    assert "exact" in out and "consumer saw all" in out
    error = float(out.split("rel. error ")[1].split()[0])
    assert error < 1e-2
