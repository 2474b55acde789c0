"""The developer guide's worked example (docs/developer_guide/example) runs as a test, and the
code shown in the guide is the code tested, so the guide cannot rot."""

import importlib.util
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import jitk
import jitk.build.jit

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "developer_guide"
EXAMPLE = GUIDE / "example"


def load_example_module():
    spec = importlib.util.spec_from_file_location("axpy_example", EXAMPLE / "axpy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return load_example_module()


def test_guide_shows_the_tested_files_verbatim():
    guide = (GUIDE / "adding_a_kernel.md").read_text()
    for name in ("axpy.cuh", "axpy.py"):
        match = re.search(rf"<!-- file: example/{re.escape(name)} -->\n```\w+\n(.*?)```", guide,
                          re.S)
        assert match, f"the guide does not show example/{name}"
        assert match.group(1) == (EXAMPLE / name).read_text(), f"the guide's {name} is stale"


def test_from_a_users_repository_validates_on_cpu(example):
    with pytest.raises(RuntimeError, match=r"Tensor match failed for 'x' Tensor<4>.* at "
                                           r"axpy.cuh:\d+ - Root cause: Device mismatch: "
                                           r"expected cuda but got cpu"):
        example.axpy(2.0, torch.randn(4), torch.randn(4))


def test_is_an_operator_that_traces_without_a_gpu(example):
    with FakeTensorMode():
        x, y = torch.empty(8, device="cuda"), torch.empty(8, device="cuda")
    graph = make_fx(lambda x, y: example.axpy(2.0, x, y))(x, y)
    assert "torch.ops.example.axpy.default(2.0, x_1, y_1)" in graph.code
    assert str(example.axpy.op._schema) == \
        "example::axpy(float alpha, Tensor x, Tensor(a2!) y) -> ()"


def test_wrong_argument_type_names_the_parameter(example):
    with pytest.raises(TypeError, match=r"^axpy\(\): 'alpha' must be a float, got str '2'$"):
        example.axpy("2", torch.randn(4), torch.randn(4))
    with pytest.raises(TypeError, match=r"^axpy\(\): 'x' must be a torch.Tensor, got None$"):
        example.axpy(2.0, None, torch.randn(4))


def test_inside_the_package_by_file_name(tmp_path, monkeypatch):
    shutil.copy(EXAMPLE / "axpy.cuh", tmp_path / "axpy.cuh")
    monkeypatch.setattr(jitk.build.jit, "KERNEL_DIR", tmp_path)
    axpy = jitk.load_jit("axpy_in_package", cuda_files=["axpy.cuh"],
                         cuda_wrappers=[("axpy", "axpy::Axpy<fp32_t>::run")]).axpy
    with pytest.raises(RuntimeError, match="Device mismatch: expected cuda but got cpu"):
        axpy(1.0, torch.randn(3), torch.randn(3))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_matches_reference_on_the_gpu(example, dtype, tol):
    for n in (1, 1000, 1 << 20):
        x = torch.randn(n, device="cuda").to(dtype)
        y = torch.randn(n, device="cuda").to(dtype)
        expected = 0.5 * x.double() + y.double()
        example.axpy(0.5, x, y)
        torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol)


@pytest.mark.gpu
def test_operator_on_the_gpu(example):
    x = torch.randn(1000, device="cuda")
    y = torch.randn(1000, device="cuda")
    torch.library.opcheck(example.axpy.op, (0.5, x, y))

    def step(x, y):
        example.axpy(0.5, x.sin(), y)
        return y * 2

    y_eager, y_compiled = y.clone(), y.clone()
    expected = step(x, y_eager)
    got = torch.compile(step, fullgraph=True)(x, y_compiled)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(y_compiled, y_eager)


@pytest.mark.gpu
def test_length_mismatch_on_the_gpu(example):
    with pytest.raises(RuntimeError, match=r"'y' Tensor<5>.*device=cuda:0\] at axpy.cuh:\d+ - Root "
                                           r"cause: Size mismatch for shape#0\('vector length'\): "
                                           r"expected 4 but got 5"):
        example.axpy(2.0, torch.randn(4, device="cuda"), torch.randn(5, device="cuda"))
