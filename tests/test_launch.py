"""LaunchKernel and the CUDA side of load_jit, through tests/csrc/launch_probe.cuh."""

import os
import subprocess
import sys

import pytest
import torch
from probes import launch_probe


def test_cuda_module_builds_and_refuses_cpu_tensors():
    with pytest.raises(RuntimeError) as info:
        launch_probe().add_one(torch.randn(8), torch.randn(8))
    message = str(info.value)
    assert "Tensor match failed for 'x' Tensor<8>" in message
    assert "Device mismatch: expected cuda but got cpu" in message
    assert "launch_probe.cuh:" in message


@pytest.mark.gpu
def test_result_matches_reference_on_random_data():
    for n in (1, 1000, 1 << 20):
        x = torch.randn(n, device="cuda")
        y = torch.full_like(x, float("nan"))
        launch_probe().add_one(x, y)
        torch.testing.assert_close(y, x + 1, rtol=0, atol=0)


@pytest.mark.gpu
def test_launches_on_the_callers_current_stream():
    source = torch.randn(1 << 22, device="cuda")
    x = torch.empty_like(source).fill_(float("nan"))
    y = torch.empty_like(source).fill_(float("nan"))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # if add_one ran on another stream it would read NaNs
        x.copy_(source)
        launch_probe().add_one(x, y)
    side.synchronize()
    torch.testing.assert_close(y, source + 1, rtol=0, atol=0)


@pytest.mark.gpu
def test_captured_in_a_cuda_graph():
    x = torch.randn(4096, device="cuda")
    y = torch.full_like(x, float("nan"))
    launch_probe().add_one(x, y)  # load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_probe().add_one(x, y)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        y.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(y, x + 1, rtol=0, atol=0)


@pytest.mark.gpu
def test_code_for_another_architecture_is_refused_at_load(tmp_path):
    major, minor = torch.cuda.get_device_capability()
    other = "8.0" if major != 8 else "9.0"
    code = ("import jitk, sys; sys.path.insert(0, 'tests'); import probes\n"
            "try:\n    probes.launch_probe()\nexcept jitk.ToolchainError as e:\n    print(e)\n")
    env = {**os.environ, "JITK_CUDA_ARCH": other, "JITK_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            cwd=os.path.dirname(os.path.dirname(__file__)), timeout=300)
    assert f"holds code for sm_{other.replace('.', '')}" in result.stdout, result.stderr
    assert f"is sm_{major}{minor}" in result.stdout
