"""The Triton Solutions scripts/fib_gpu.py benchmarks jitk's beside (scripts/fib_triton.py):
on CPU, each loads through flashinfer-bench's own models, its source parses, defines the entry
point it declares with the Definition's inputs and carries the Definition's hidden size and
eps; where Triton is installed, FlashInfer-Bench's TritonBuilder builds it and it computes
the Definition's reference, on a GPU or else in Triton's interpreter. Skipped where
flashinfer-bench is not installed."""

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("flashinfer_bench") is None:  # installed but broken: fail
    pytest.skip("flashinfer-bench is not installed: pip install -e '.[fib]'",
                allow_module_level=True)
from flashinfer_bench import data as fib_data  # noqa: E402

import jitk.fib  # noqa: E402
from jitk.base.errors import ArgumentError  # noqa: E402
from jitk.integrations import fib_norm  # noqa: E402

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fib_triton.py"
_spec = importlib.util.spec_from_file_location("fib_triton", _SCRIPT)
fib_triton = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fib_triton)

CASES = [("rmsnorm", 2048, torch.bfloat16, 1e-5), ("fused_add_rmsnorm", 7168, torch.bfloat16, 1e-5),
         ("rmsnorm", 5120, torch.float16, 1e-6), ("fused_add_rmsnorm", 4096, torch.float32, 1e-6)]


def _constants(tree: ast.Module) -> dict[str, object]:
    return {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Constant)}


@pytest.mark.parametrize("op, hidden, dtype, eps", CASES)
def test_a_triton_solution_loads_in_flashinfer_benchs_trace_set(tmp_path, op, hidden, dtype,
                                                                eps):
    definition = fib_norm.definition(op, hidden, dtype, eps)
    solution = fib_triton.triton_solution(definition)
    for folder, item in (("definitions", definition), ("solutions", solution)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / f"{item.name}.json").write_text(item.model_dump_json())
    loaded = fib_data.TraceSet.from_path(str(tmp_path)).get_solution(f"{definition.name}_triton")
    assert loaded == solution
    assert loaded.definition == definition.name
    assert loaded.spec.language == fib_data.SupportedLanguages.TRITON
    assert loaded.spec.destination_passing_style is False  # value-returning, as torch's


@pytest.mark.parametrize("op, hidden, dtype, eps", CASES)
def test_a_triton_solutions_source_defines_its_entry_point_over_the_definitions_inputs(
        op, hidden, dtype, eps):
    definition = fib_norm.definition(op, hidden, dtype, eps)
    solution = fib_triton.triton_solution(definition)
    source = solution.get_entry_source()
    assert source is not None and source.path == str(solution.get_entry_path())
    tree = ast.parse(source.content)
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    entry = functions[solution.get_entry_symbol()]
    assert [arg.arg for arg in entry.args.args] == list(definition.inputs)
    assert any(ast.unparse(d) == "triton.jit" for f in functions.values()
               for d in f.decorator_list)
    assert _constants(tree).items() >= {"HIDDEN": hidden, "EPS": eps}.items()
    launch = next(node for node in ast.walk(entry) if isinstance(node, ast.Call)
                  and isinstance(node.func, ast.Subscript))
    adds = next(k.value for k in launch.keywords if k.arg == "add_residual")
    assert ast.literal_eval(adds) is (op == "fused_add_rmsnorm")


def test_a_triton_solution_refuses_a_definition_whose_reference_disagrees_on_eps():
    definition = fib_norm.definition("rmsnorm", 2048)
    wrong = definition.model_copy(update={"reference": definition.reference.replace(
        "1e-05", "1e-06")})
    with pytest.raises(ArgumentError, match="eps"):
        fib_triton.triton_solution(wrong)


def check_against_the_reference(op: str, dtype: torch.dtype, rows: int, device: str) -> None:
    """Built by FlashInfer-Bench's TritonBuilder: within one rounding step of the Definition's
    float32 reference at a width that is not a power of two (masked lanes), the inputs
    untouched."""
    from flashinfer_bench.compile.builders import TritonBuilder

    definition = fib_norm.definition(op, 7168, dtype, 1e-5)
    runnable = TritonBuilder().build(definition, fib_triton.triton_solution(definition))
    x, residual = (torch.randn(rows, 7168, device=device).to(dtype) for _ in range(2))
    weight = torch.randn(7168, device=device).to(dtype)
    inputs = [x, residual, weight] if op == "fused_add_rmsnorm" else [x, weight]
    kept = [t.clone() for t in inputs]
    try:
        output = runnable(*inputs)
        if device == "cuda":
            torch.cuda.synchronize()
    finally:
        runnable.cleanup()
    namespace = {}
    exec(definition.reference, namespace)  # noqa: S102 - the Definition's own reference
    reference = namespace["run"](*inputs).float()
    step = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    assert output.dtype == dtype and output.shape == x.shape
    assert ((output.float() - reference).abs() <= reference.abs() * 2 * step + 1e-6).all()
    assert all(map(torch.equal, inputs, kept))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("op", ["rmsnorm", "fused_add_rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 77, 1024])
def test_a_triton_solution_built_by_flashinfer_bench_computes_the_reference(op, dtype, rows):
    pytest.importorskip("triton")
    check_against_the_reference(op, dtype, rows, "cuda")


@pytest.mark.parametrize("op", ["rmsnorm", "fused_add_rmsnorm"])
def test_a_triton_solution_computes_the_reference_in_tritons_interpreter(op, tmp_path):
    """Without a GPU where Triton is installed: the same check on CPU tensors, in a process
    of its own (TRITON_INTERPRET is read as Triton starts), with a time limit."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    code = ("import sys, torch, test_fib_triton as t; "
            f"t.check_against_the_reference({op!r}, torch.bfloat16, 5, 'cpu')")
    env = {**os.environ, "TRITON_INTERPRET": "1", "FIB_CACHE_PATH": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                          os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-4000:]


def _trace(definition, kind: str, status: str, speedup: float) -> object:
    passed = status == "PASSED"
    evaluation = fib_data.Evaluation(
        status=status, environment={"hardware": "test"}, timestamp="2026-01-01T00:00:00",
        correctness={} if status in ("PASSED", "INCORRECT_NUMERICAL") else None,
        performance={"latency_ms": 1.0, "reference_latency_ms": speedup,
                     "speedup_factor": speedup} if passed else None)
    return fib_data.Trace(definition=definition.name, solution=f"{definition.name}_{kind}",
                          workload={"axes": {"batch_size": 1}, "inputs": {}, "uuid": "u"},
                          evaluation=evaluation)


@pytest.fixture
def fib_gpu(monkeypatch):
    """scripts/fib_gpu.py as a module, what it sets on import undone afterwards."""
    monkeypatch.setenv("NVCC_APPEND_FLAGS", fib_norm.NVCC_APPEND_FLAGS)
    monkeypatch.delenv("FIB_GPU_BUILDER", raising=False)
    monkeypatch.syspath_prepend(str(_SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("fib_gpu", _SCRIPT.parent / "fib_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmarks_trace_set_holds_jitks_torchs_and_tritons_solution_of_each(fib_gpu,
                                                                                   tmp_path):
    jitk.fib.export(tmp_path, list(fib_norm.OPS), hidden=[2048, 7168])
    fib_gpu.write_workloads(tmp_path)
    trace_set = fib_data.TraceSet.from_path(str(tmp_path))
    assert len(trace_set.definitions) == 4
    for name in trace_set.definitions:
        languages = {s.name: s.spec.language.value for s in trace_set.solutions[name]}
        assert languages == {f"{name}_jitk": "cuda", f"{name}_torch": "python",
                             f"{name}_triton": "triton"}
        assert len(trace_set.workloads[name]) == len(fib_gpu.BATCH_SIZES)


def test_the_summary_gives_each_familys_geometric_mean_over_its_passed_workloads(fib_gpu):
    small, large = (fib_norm.definition("rmsnorm", hidden) for hidden in (2048, 4096))
    fused = fib_norm.definition("fused_add_rmsnorm", 2048)
    traces = {small.name: [_trace(small, "jitk", "PASSED", 2.0),
                           _trace(small, "triton", "COMPILE_ERROR", 0.0),
                           _trace(small, "torch", "PASSED", 3.0)],
              large.name: [_trace(large, "jitk", "PASSED", 8.0),
                           _trace(large, "torch", "INCORRECT_NUMERICAL", 0.0),
                           _trace(large, "triton", "PASSED", 1.5)],
              fused.name: [_trace(fused, "jitk", "PASSED", 5.0)]}
    definitions = {d.name: d for d in (small, large, fused)}
    assert fib_gpu.summary_rows(definitions, traces) == [
        ("fused_add_rmsnorm", "jitk", "5.00x", "1 of 1"),
        ("rmsnorm", "jitk", "4.00x", "2 of 2"),
        ("rmsnorm", "torch", "3.00x", "1 of 2"),
        ("rmsnorm", "triton", "1.50x", "1 of 2")]
