"""FlashInfer-Bench: exported Definitions and Solutions load in flashinfer-bench's own models
and their references compute what the ops' references do; jitk's builder builds a Solution
for sm_90 through flashinfer-bench's registry, and a broken one's compiler lines reach
BuildError. Skipped where flashinfer-bench is not installed (pip install jitk[fib])."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("flashinfer_bench") is None:  # installed but broken: fail
    pytest.skip("flashinfer-bench is not installed: pip install -e '.[fib]'",
                allow_module_level=True)
from fib_stock import stock_build  # noqa: E402
from flashinfer_bench import data as fib_data  # noqa: E402
from flashinfer_bench.compile import BuilderRegistry, BuildError  # noqa: E402

import jitk  # noqa: E402
import jitk.fib  # noqa: E402
from jitk.cli.main import main  # noqa: E402
from jitk.integrations import fib_norm  # noqa: E402


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


def test_export_writes_a_trace_set_in_the_datasets_form(tmp_path):
    assert main(["fib", "export", str(tmp_path), "--hidden", "2048", "4096",
                 "--dtype", "bfloat16", "float16", "--eps", "1e-5"]) == 0
    traces = fib_data.TraceSet.from_path(str(tmp_path))  # flashinfer-bench's own loader
    rmsnorm_names = [f"{op}_h{hidden}{suffix}" for op in ("rmsnorm", "fused_add_rmsnorm")
                     for hidden in (2048, 4096) for suffix in ("", "_float16")]
    hicache_names = [f"jitk_hicache_{kind}_{row}_{dtype}" for kind, row in (
        ("one_layer", "8x128"), ("one_layer_mla", "576"), ("all_layer", "8x128"),
        ("all_layer_mla", "576")) for dtype in ("bfloat16", "float16")]
    assert sorted(traces.definitions) == sorted([*rmsnorm_names, *hicache_names])
    assert all(len(traces.solutions[name]) == 1 for name in hicache_names)
    for path in (tmp_path / "definitions").rglob("*.json"):  # the folder is the op_type
        assert traces.definitions[path.stem].op_type == path.parent.name
    fused = traces.definitions["fused_add_rmsnorm_h4096"]
    assert list(fused.inputs) == ["hidden_states", "residual", "weight"]
    assert list(fused.outputs) == ["output"] and fused.op_type == "rmsnorm"
    assert fused.inputs["residual"].dtype == "bfloat16"
    assert fused.axes["batch_size"].type == "var" and fused.axes["hidden_size"].value == 4096
    assert list(traces.definitions["rmsnorm_h2048_float16"].inputs) == ["hidden_states",
                                                                       "weight"]
    for name in rmsnorm_names:
        (solution,) = traces.solutions[name]
        assert solution.spec.destination_passing_style and solution.spec.binding == "tvm-ffi"
        paths = [source.path for source in solution.sources]
        assert paths[:2] == ["main.cu", "rmsnorm.cuh"] and "jitk/utils.cuh" in paths
        for source in solution.sources:  # the kernel's own files it includes ship beside it
            for included in re.findall(r'#include "([\w./]+)"', source.content):
                assert included in paths, (source.path, included)
        main_cu = solution.get_entry_source().content
        assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, run);" in main_cu
        assert f"RMSNorm<{name.split('_h')[1].split('_')[0]}, " in main_cu


def test_a_solution_carries_the_instantiation_jitk_picks_for_each_row_bucket(monkeypatch):
    """A tuning file's choice for 16 rows (and only there) reaches the Solution's dispatch."""
    from jitk.kernels import norm

    tuned = "jitk::norm::RMSNorm<4096, bf16_t, jitk::norm::Tuning<8, true>>"
    picks = {16: tuned}
    monkeypatch.setattr(norm, "instantiation", lambda op, hidden, dtype, rows:
                        picks.get(rows, f"jitk::norm::RMSNorm<{hidden}, bf16_t>"))
    main_cu = jitk.fib.solution(fib_norm.definition("rmsnorm", 4096)).sources[0].content
    assert "if (rows <= 8) return jitk::norm::RMSNorm<4096, bf16_t>::run(" in main_cu
    assert f"if (rows <= 16) return {tuned}::run(" in main_cu
    assert "  jitk::norm::RMSNorm<4096, bf16_t>::run(hidden_states" in main_cu  # the rest


def test_instantiation_is_the_default_without_a_tuning_file(no_shipped_table):
    from jitk.kernels import norm

    assert norm.instantiation("fused_add_rmsnorm", 4096, torch.bfloat16, 77) == \
        "jitk::norm::RMSNorm<4096, bf16_t>"
    with pytest.raises(jitk.ArgumentError, match="'rows' must be an int >= 1, got 0"):
        norm.instantiation("rmsnorm", 4096, torch.bfloat16, 0)


@pytest.mark.parametrize("op", ["rmsnorm", "fused_add_rmsnorm"])
def test_a_definitions_reference_matches_jitks_reference(op):
    definition = fib_norm.definition(op, 256, torch.float32, 1e-5)
    x, residual = torch.randn(5, 256), torch.randn(5, 256)
    weight = torch.randn(256)
    inputs = (x, weight) if op == "rmsnorm" else (x, residual, weight)
    got = run_of(definition)(*inputs)
    want = torch.empty_like(x)
    if op == "rmsnorm":
        jitk.runtime.op.find_op(op).reference(x, weight, want, 1e-5)
    else:
        want, summed = x.clone(), residual.clone()
        jitk.runtime.op.find_op(op).reference(want, summed, weight, 1e-5)
    torch.testing.assert_close(got, want)
    assert torch.equal(inputs[0], x)  # value-returning: the inputs are left as they were


def test_solution_checks_the_definition_against_the_kernel():
    good = fib_norm.definition("fused_add_rmsnorm", 4096)
    assert jitk.fib.solution(good).definition == "fused_add_rmsnorm_h4096"
    changed = lambda **fields: fib_data.Definition(**{**good.model_dump(), **fields})
    with pytest.raises(jitk.ArgumentTypeError, match="must be a flashinfer_bench Definition"):
        jitk.fib.solution("fused_add_rmsnorm_h4096")
    inputs = good.model_dump()["inputs"]
    with pytest.raises(jitk.ArgumentError, match=r"takes \(hidden_states, weight\) -> output"
                       r"; jitk's fused_add_rmsnorm kernel takes \(hidden_states, residual"):
        jitk.fib.solution(changed(inputs={k: v for k, v in inputs.items() if k != "residual"}))
    with pytest.raises(jitk.ArgumentTypeError, match="residual: float16"):
        jitk.fib.solution(changed(inputs={**inputs, "residual": {
            **inputs["residual"], "dtype": "float16"}}))
    with pytest.raises(jitk.ArgumentError, match=r"eps constants are \[1e-06\]; the name "
                       r"\(and so jitk's kernel\) says 1e-05"):
        jitk.fib.solution(changed(reference=good.reference.replace("1e-05", "1e-06")))
    with pytest.raises(jitk.ArgumentError, match="axis 'hidden_size' must be const 4096"):
        jitk.fib.solution(changed(axes={**good.model_dump()["axes"], "hidden_size": {
            "type": "const", "value": 2048}}))
    with pytest.raises(jitk.ArgumentError, match="is not named"):
        jitk.fib.solution(changed(name="add_rmsnorm_h4096"))


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


def test_export_into_a_folder_it_cannot_make_says_so_in_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["fib", "export", str(blocker / "out"), "rmsnorm", "--hidden", "128"]) == 1
    error = capsys.readouterr().err
    assert f"cannot write {blocker / 'out'}" in error and "Traceback" not in error, error


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


def rmsnorm_pair():
    definition = fib_norm.definition("rmsnorm", 128)
    return definition, jitk.fib.solution(definition)


def test_the_builder_builds_a_shipped_solution_for_sm90(registry):
    definition, solution = rmsnorm_pair()
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
    definition, solution = rmsnorm_pair()
    entry, *others = solution.sources
    broken = fib_data.Solution(**{
        **solution.model_dump(), "name": "broken",
        "sources": [{"path": entry.path, "content": entry.content.replace(
            "hidden_states.numel()", "inptu.numel()")}, *(f.model_dump() for f in others)]})
    with pytest.raises(BuildError) as failure:
        registry.build(definition, broken)
    message = str(failure.value)
    assert message.startswith("jitk failed to compile Solution 'broken':")
    assert 'main.cu(' in message and 'error: identifier "inptu" is undefined' in message


# ------------------------------------------------- flashinfer-bench's own tooling, no jitk
def test_flashinfer_benchs_own_builder_compiles_jitks_solution_for_sm90(tmp_path):
    """Its stock tvm-ffi builder, in a process where jitk cannot be imported, builds the
    fused Solution from the exported folder alone (sm_90 through TVM_FFI_CUDA_ARCH_LIST)."""
    jitk.fib.export(tmp_path / "set", ["fused_add_rmsnorm"], hidden=[2048])
    (line,) = stock_build(tmp_path, tmp_path / "set", ["fused_add_rmsnorm_h2048"])
    assert line.startswith("built fused_add_rmsnorm_h2048 tvm_ffi ") and line.endswith(".so")


# ------------------------------------------------------------------- logs to Workloads
_LOGGED_RUN = """
import torch, jitk
x = torch.randn(3, 4096).bfloat16()
jitk.fused_add_rmsnorm(x, torch.randn_like(x), torch.randn(4096).bfloat16(), eps=1e-5)
y = torch.randn(5, 2, 2048).half()
jitk.rmsnorm(y, torch.randn(2048).half(), torch.empty_like(y), 1e-6)
jitk.rmsnorm(y, torch.randn(2048).half(), torch.empty_like(y), 1e-6)  # the same shape again
print("the program's own output")
"""


def _logged_run(tmp_path, level: int) -> Path:
    """The program above run on CPU (the ops' references) with the call log at `level`."""
    log = tmp_path / f"calls{level}.log"
    env = {**os.environ, "JITK_LOGLEVEL": str(level), "JITK_REFERENCE": "all",
           "JITK_LOGDEST": str(log), "JITK_DUMP_DIR": str(tmp_path / "dumps"),
           "JITK_DUMP_INCLUDE": "*fused_add_rmsnorm*"}
    done = subprocess.run([sys.executable, "-c", _LOGGED_RUN], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return log


def test_a_logged_run_becomes_workloads_flashinfer_bench_loads(tmp_path):
    log = _logged_run(tmp_path, 3)
    assert main(["fib", "workloads", str(log), str(tmp_path / "set")]) == 0
    traces = fib_data.TraceSet.from_path(str(tmp_path / "set"))
    assert sorted(traces.workloads) == ["fused_add_rmsnorm_h4096", "rmsnorm_h2048_float16_eps1e-06"]
    (fused,) = traces.workloads["fused_add_rmsnorm_h4096"]
    assert fused.workload.axes == {"batch_size": 3}
    assert set(fused.workload.inputs) == {"hidden_states", "residual", "weight"}
    (norm,) = traces.workloads["rmsnorm_h2048_float16_eps1e-06"]  # one a shape
    assert norm.workload.axes == {"batch_size": 10}
    assert traces.definitions["rmsnorm_h2048_float16_eps1e-06"].inputs["weight"].dtype == \
        "float16"
    assert [s.name for s in traces.solutions["fused_add_rmsnorm_h4096"]] == [
        "fused_add_rmsnorm_h4096_jitk"]


def test_a_dumped_call_becomes_a_workload_of_its_own_tensors(tmp_path):
    from safetensors.torch import load_file

    log = _logged_run(tmp_path, 10)
    counts = jitk.fib.workloads([log], tmp_path / "set")
    assert counts == {"fused_add_rmsnorm_h4096": 1, "rmsnorm_h2048_float16_eps1e-06": 1}
    traces = fib_data.TraceSet.from_path(str(tmp_path / "set"))
    (fused,) = traces.workloads["fused_add_rmsnorm_h4096"]
    spec = fused.workload.inputs["hidden_states"]
    assert spec.type == "safetensors" and spec.tensor_key == "input"
    (dump,) = (tmp_path / "dumps").iterdir()
    stored = load_file(str(tmp_path / "set" / spec.path))
    assert torch.equal(stored["input"], load_file(str(dump / "inputs.safetensors"))["input"])
    assert stored["input"].shape == (3, 4096)


def test_apply_config_refuses_an_unknown_dtype_and_a_bad_step_count():
    with pytest.raises(jitk.ArgumentError, match="'dtype' must be one of bfloat16, float16"):
        jitk.fib.apply_config("int8")
    with pytest.raises(jitk.ArgumentError, match="'ulps' must be an int >= 1, got 0"):
        jitk.fib.apply_config("float16", 0)
    assert jitk.fib.apply_config("float16", 1).max_rtol == 2.0**-10


def test_workloads_refuse_a_missing_log(tmp_path):
    with pytest.raises(jitk.ArgumentError, match="log '/no/such.log' is not a file"):
        jitk.fib.workloads(["/no/such.log"], tmp_path)


# --------------------------------------------------------------------------- apply()
def _passed_trace(definition: str, solution: str, rows: int) -> object:
    evaluation = fib_data.Evaluation(
        status="PASSED", environment=fib_data.Environment(hardware="test"),
        # what a bf16 output one rounding step off the reference reports
        timestamp="2026-01-01T00:00:00", correctness=fib_data.Correctness(
            max_absolute_error=0.0625, max_relative_error=2.0**-7),
        performance=fib_data.Performance(latency_ms=1.0, reference_latency_ms=2.0,
                                         speedup_factor=2.0))
    return fib_data.Trace(definition=definition, solution=solution, evaluation=evaluation,
                          workload=fib_data.Workload(axes={"batch_size": rows}, inputs={
                              k: fib_data.RandomInput() for k in ("hidden_states", "residual",
                                                                  "weight")}, uuid=f"w{rows}"))


def test_apply_routes_to_jitks_solution_and_falls_back_where_none_qualifies(tmp_path,
                                                                             monkeypatch):
    """The benchmark's passed trace at 4 rows makes apply() pick jitk's Solution there (the
    GPU script runs it); at 7 rows nothing qualifies and the decorated function runs."""
    from flashinfer_bench import apply, disable_apply, enable_apply
    from flashinfer_bench.apply import ApplyConfig, ApplyConfigRegistry
    from flashinfer_bench.apply.key import ApplyKey
    from flashinfer_bench.apply.table import ApplyTable

    monkeypatch.setenv("FIB_CACHE_PATH", str(tmp_path / "cache"))
    jitk.fib.export(tmp_path / "set", ["fused_add_rmsnorm"], hidden=[4096])
    traces = tmp_path / "set" / "traces" / "rmsnorm" / "fused_add_rmsnorm_h4096.jsonl"
    traces.parent.mkdir(parents=True)
    traces.write_text(_passed_trace("fused_add_rmsnorm_h4096", "fused_add_rmsnorm_h4096_jitk",
                                    4).model_dump_json() + "\n")
    trace_set = fib_data.TraceSet.from_path(str(tmp_path / "set"))
    at = lambda rows: ApplyKey(axes=(("batch_size", rows),))
    stock = ApplyConfigRegistry(default=ApplyConfig(aot_ratio=0.0))
    assert ApplyTable.load_or_build(trace_set, stock).match_solution(  # its tolerances admit
        "fused_add_rmsnorm_h4096", at(4)) is None  # no 16-bit output
    config = ApplyConfigRegistry(default=jitk.fib.apply_config("bfloat16", aot_ratio=0.0))
    table = ApplyTable.load_or_build(trace_set, config)  # nothing built ahead (aot_ratio)
    assert table.match_solution("fused_add_rmsnorm_h4096", at(4)) == \
        "fused_add_rmsnorm_h4096_jitk"
    assert table.match_solution("fused_add_rmsnorm_h4096", at(7)) is None

    @apply("fused_add_rmsnorm_h4096")
    def fused_add_rmsnorm(hidden_states, residual, weight):
        x = hidden_states.float() + residual.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()
                ).to(hidden_states.dtype)

    x, residual = (torch.randn(7, 4096).bfloat16() for _ in range(2))
    weight = torch.randn(4096).bfloat16()
    enable_apply(str(tmp_path / "set"), config)
    try:
        got = fused_add_rmsnorm(x, residual, weight)
    finally:
        disable_apply()
    want = run_of(fib_norm.definition("fused_add_rmsnorm", 4096))(x, residual, weight)
    assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("op", ["rmsnorm", "fused_add_rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 77, 1024])
@pytest.mark.parametrize("hidden", [2048, 1001])
def test_a_norm_solution_gives_jitks_bits_and_leaves_its_inputs(op, dtype, rows, hidden,
                                                                monkeypatch):
    """Built by FlashInfer-Bench's own builder, on fresh random rows into a poisoned output:
    the bits jitk's own op gives (the fused form through RMSNorm in place on the sum), within
    one step of the Definition's float32 reference, and the inputs untouched. An odd width
    takes the fused form's element-wise add, 2048 its 16-byte one."""
    monkeypatch.setenv("NVCC_APPEND_FLAGS", fib_norm.NVCC_APPEND_FLAGS)  # for its builder
    definition = fib_norm.definition(op, hidden, dtype, 1e-5)
    runnable = BuilderRegistry.get_instance().build(definition, jitk.fib.solution(definition))
    x, residual = (torch.randn(rows, hidden, device="cuda").to(dtype) for _ in range(2))
    weight = torch.randn(hidden, device="cuda").to(dtype)
    inputs = [x, residual, weight] if op == "fused_add_rmsnorm" else [x, weight]
    kept = [t.clone() for t in inputs]
    output = torch.full_like(x, float("nan"))
    runnable.call_destination_passing(*inputs, output)
    torch.cuda.synchronize()
    if op == "rmsnorm":
        want = jitk.rmsnorm(x, weight, torch.empty_like(x), eps=1e-5)
    else:
        want, summed = x.clone(), residual.clone()
        jitk.fused_add_rmsnorm(want, summed, weight, eps=1e-5)
    assert torch.equal(output, want)
    assert all(map(torch.equal, inputs, kept))
    reference = run_of(definition)(*inputs).float()
    step = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    assert ((output.float() - reference).abs() <= reference.abs() * 2 * step + 1e-6).all()
    runnable.cleanup()
