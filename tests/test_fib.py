"""FlashInfer-Bench: exported Definitions and Solutions load in flashinfer-bench's own models
and their references compute what the ops' references do; jitk's builder builds a Solution
for sm_90 through flashinfer-bench's registry, and a broken one's compiler lines reach
BuildError. Skipped where flashinfer-bench is not installed (pip install jitk[fib])."""

import importlib.util
import os
import sys

import pytest
import torch

if importlib.util.find_spec("flashinfer_bench") is None:  # installed but broken: fail
    pytest.skip("flashinfer-bench is not installed: pip install -e '.[fib]'",
                allow_module_level=True)
from flashinfer_bench import data as fib_data  # noqa: E402
from flashinfer_bench.compile import BuilderRegistry, BuildError  # noqa: E402

import jitk  # noqa: E402
import jitk.fib  # noqa: E402
from jitk.cli.main import main  # noqa: E402
from jitk.kernels.norm import COMMON_SIZES  # noqa: E402


def _shifted_reference(x: torch.Tensor, table: torch.Tensor, out: torch.Tensor,
                       shift: int = 1) -> None:
    out.copy_(_shifted(x, shift) + table.sum())


def _shifted(x: torch.Tensor, shift: int) -> torch.Tensor:
    return torch.roll(x, shift, dims=-1)


@jitk.op("fibtest::shifted", mutates_args=("out",), reference=_shifted_reference)
def shifted(x: torch.Tensor, table: torch.Tensor, out: torch.Tensor, shift: int = 1) -> None:
    out.copy_(_shifted(x, shift) + table.sum())


@jitk.op("fibtest::unreferenced", mutates_args=("out",))
def unreferenced(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x)


def run_of(definition):
    namespace = {}
    exec(definition.reference, namespace)  # noqa: S102 - the exported source under test
    return namespace["run"]


def test_export_writes_definitions_and_solutions_that_flashinfer_bench_loads(tmp_path):
    assert main(["fib", "export", str(tmp_path)]) == 0
    definitions = sorted((tmp_path / "definitions").rglob("*.json"))
    solutions = sorted((tmp_path / "solutions").rglob("*.json"))
    assert len(solutions) == 2 * len(COMMON_SIZES)  # the RMSNorm kernels
    assert len(definitions) == len(solutions) + 2  # and the two one-layer KV transfers
    loaded = {d.name: d for d in (fib_data.load_json_file(fib_data.Definition, p)
                                  for p in definitions)}
    for path in solutions:
        solution = fib_data.load_json_file(fib_data.Solution, path)
        definition = loaded[solution.definition]
        assert solution.spec.language == "cuda" and solution.spec.binding == "tvm-ffi"
        hidden = definition.axes["hidden_size"]
        assert definition.axes["batch_size"].type == "var" and hidden.type == "const"
        assert f"RMSNorm<{hidden.value}, jitk::" in solution.get_entry_source().content
    rmsnorm = loaded["jitk_rmsnorm_h4096_bfloat16"]
    assert list(rmsnorm.inputs) == ["input", "weight"] and list(rmsnorm.outputs) == ["out"]
    assert rmsnorm.inputs["weight"].shape == ["hidden_size"]
    fused = loaded["jitk_fused_add_rmsnorm_h4096_float16"]
    assert list(fused.outputs) == ["input_out", "residual_out"]
    assert fused.outputs["residual_out"].dtype == "float16"


@pytest.mark.parametrize("op", ["rmsnorm", "fused_add_rmsnorm"])
def test_a_definitions_reference_computes_what_the_ops_reference_does(op):
    info = jitk.runtime.op.find_op(op)
    example = jitk.fib._SHIPPED[info.name].examples()[0]
    run = run_of(jitk.fib._shipped_definition(info, example))
    hidden, dtype = example[0].shape[-1], example[0].dtype
    x, residual = (torch.randn(3, hidden).to(dtype) for _ in range(2))
    weight = torch.randn(hidden).to(dtype)
    if op == "rmsnorm":
        want = torch.empty_like(x)
        info.reference(x, weight, want, 1e-6)
        assert torch.equal(run(x, weight), want)
    else:
        inputs = (x.clone(), residual.clone())
        info.reference(*inputs, weight, 1e-6)
        assert all(map(torch.equal, run(x, residual, weight), inputs))


@pytest.mark.parametrize("op", ["transfer_hicache_one_layer", "transfer_hicache_one_layer_mla"])
def test_a_kv_transfer_definition_copies_what_its_reference_does(op):
    info = jitk.runtime.op.find_op(op)
    (example,) = jitk.fib._SHIPPED[info.name].examples()
    definition = jitk.fib._shipped_definition(info, example)
    assert definition.axes["num_tokens"].type == "var"
    caches = len(definition.outputs)
    dst = [torch.randn(t.shape).to(t.dtype) for t in example[:caches]]
    src = [torch.randn(t.shape).to(t.dtype) for t in example[caches + 1:-1]]
    indices_dst, indices_src = torch.randperm(32)[:16], torch.randperm(64)[:16]
    got = run_of(definition)(*dst, indices_dst, *src, indices_src)
    got = got if isinstance(got, tuple) else (got,)
    want = [t.clone() for t in dst]
    info.reference(*want, indices_dst, *src, indices_src)
    assert all(map(torch.equal, got, want))
    assert not any(map(torch.equal, got, dst))  # rows were copied, the inputs kept


def test_a_user_ops_definition_names_its_axes_and_fixes_its_scalars():
    x, table, out = torch.randn(4, 6), torch.ones(3), torch.empty(4, 6)
    definition = jitk.fib.definition(shifted.info, x, table, out, shift=2,
                                     axes={"x": ("rows", "width"), "out": ("rows", "width")},
                                     const=("width",), write_only=("out",))
    assert definition.name == "shifted_width6"
    assert {n: a.type for n, a in definition.axes.items()} == {
        "rows": "var", "width": "const", "table_0": "var"}
    assert list(definition.inputs) == ["x", "table"] and list(definition.outputs) == ["out"]
    assert "shift=2" in definition.description
    want = torch.empty_like(out)
    _shifted_reference(x, table, want, 2)
    assert torch.equal(run_of(definition)(x, table), want)


def test_definitions_refuse_what_they_cannot_describe():
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match="has no reference"):
        jitk.fib.definition(unreferenced.info, x, x)
    with pytest.raises(ValueError, match="axis 'n' is 4 in one tensor and 6 in 'out'"):
        jitk.fib.definition(shifted.info, x, torch.ones(3), torch.empty(6, 4),
                            axes={"x": ("n", "m"), "out": ("n", "m")})
    with pytest.raises(ValueError, match="'shift' is not a tensor parameter"):
        jitk.fib.definition(shifted.info, x, torch.ones(3), x, axes={"shift": ("n",)})
    with pytest.raises(SystemExit) as stop:
        main(["fib", "export", "/tmp/unused", "no_such_op"])
    assert stop.value.code == 2


def test_export_without_flashinfer_bench_fails_with_the_install_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "flashinfer_bench", None)  # import raises ImportError
    assert main(["fib", "export", "/tmp/unused"]) == 1
    assert "pip install 'jitk[fib]'" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the builder
@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    before = os.environ.get("FIB_CACHE_PATH")
    os.environ["FIB_CACHE_PATH"] = str(tmp_path_factory.mktemp("fib-cache"))
    builder = jitk.fib.install_builder()
    assert jitk.fib.install_builder() is builder  # once, first in line
    instance = BuilderRegistry.get_instance()
    assert instance._builders[0] is builder
    yield instance
    if before is None:
        del os.environ["FIB_CACHE_PATH"]
    else:
        os.environ["FIB_CACHE_PATH"] = before


def shipped_pair(op):
    info = jitk.runtime.op.find_op(op)
    example = jitk.fib._SHIPPED[info.name].examples()[0]
    definition = jitk.fib._shipped_definition(info, example)
    return definition, jitk.fib.solution(info, example, definition.name)


def test_the_builder_builds_a_shipped_solution_for_sm90(registry):
    definition, solution = shipped_pair("rmsnorm")
    built = registry.build(definition, solution)
    assert built.metadata.build_type == "jitk"
    assert built.metadata.solution_name == solution.name
    with pytest.raises(RuntimeError, match="Device mismatch: expected cuda but got cpu"):
        built(torch.ones(1, 128, dtype=torch.bfloat16), torch.ones(128, dtype=torch.bfloat16),
              torch.empty(1, 128, dtype=torch.bfloat16))  # the kernel's own checks ran


def test_a_tvm_ffi_style_solution_builds_through_its_export_line(registry):
    source = """\
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>

__global__ void twice(const float* x, float* y, int64_t n) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = 2.0f * x[i];
}

void run(tvm::ffi::TensorView x, tvm::ffi::TensorView y) {
  const int64_t n = x.size(0);
  twice<<<(n + 255) / 256, 256>>>(static_cast<const float*>(x.data_ptr()),
                                  static_cast<float*>(y.data_ptr()), n);
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, run);
"""
    definition = fib_data.Definition(
        name="twice", op_type="elementwise", axes={"n": {"type": "var"}},
        inputs={"x": {"shape": ["n"], "dtype": "float32"}},
        outputs={"y": {"shape": ["n"], "dtype": "float32"}},
        reference="def run(x):\n    return 2 * x\n")
    solution = fib_data.Solution(
        name="twice_cuda", definition="twice", author="test",
        spec=fib_data.BuildSpec(language="cuda", target_hardware=["cuda"],
                                entry_point="kernel.cu::run"),
        sources=[fib_data.SourceFile(path="kernel.cu", content=source)])
    assert registry.build(definition, solution).metadata.build_type == "jitk"


def test_a_broken_solutions_compiler_lines_reach_build_error(registry):
    definition, solution = shipped_pair("rmsnorm")
    entry = solution.sources[0]
    broken = fib_data.Solution(**{
        **solution.model_dump(), "name": "broken",
        "sources": [{"path": entry.path, "content": entry.content.replace("(input,", "(inptu,")},
                    solution.sources[1].model_dump()]})
    with pytest.raises(BuildError) as failure:
        registry.build(definition, broken)
    message = str(failure.value)
    assert message.startswith("jitk failed to compile Solution 'broken':")
    assert 'main.cuh(' in message and 'error: identifier "inptu" is undefined' in message
