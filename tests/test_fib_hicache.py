"""FlashInfer-Bench and the HiCache transfers: jitk's Definitions and Solutions load in
flashinfer-bench's own models, the Definitions' references move what jitk.hicache's
references move, solution() checks a Definition against the kernel, and flashinfer-bench's
stock builder compiles the Solutions for sm_90; on a GPU, a Solution's outputs equal its
Definition's reference's."""

import importlib.util
import json

import pytest
import torch

if importlib.util.find_spec("flashinfer_bench") is None:  # installed but broken: fail
    pytest.skip("flashinfer-bench is not installed: pip install -e '.[fib]'",
                allow_module_level=True)
from fib_stock import stock_build  # noqa: E402
from flashinfer_bench import data as fib_data  # noqa: E402

import jitk.fib  # noqa: E402
from jitk.base.errors import ArgumentError, ArgumentTypeError  # noqa: E402
from jitk.cli.main import main  # noqa: E402
from jitk.integrations import fib_hicache, fib_norm  # noqa: E402
from jitk.kernels.hicache import reference  # noqa: E402

NAMES = {"one_layer": "jitk_hicache_one_layer_8x128_bfloat16",
         "one_layer_mla": "jitk_hicache_one_layer_mla_576_bfloat16",
         "all_layer": "jitk_hicache_all_layer_8x128_bfloat16",
         "all_layer_mla": "jitk_hicache_all_layer_mla_576_bfloat16"}


def run_of(definition):
    namespace = {}
    exec(definition.reference, namespace)  # noqa: S102 - the exported source under test
    return namespace["run"]


def test_export_of_the_family_writes_what_flashinfer_bench_loads(tmp_path):
    assert main(["fib", "export", str(tmp_path), "--family", "hicache"]) == 0
    traces = fib_data.TraceSet.from_path(str(tmp_path))  # flashinfer-bench's own loader
    assert sorted(traces.definitions) == sorted(NAMES.values())
    for kind, name in NAMES.items():
        definition = traces.definitions[name]
        assert definition.op_type == "kv_transfer" and definition.axes["num_tokens"].type == "var"
        (solution,) = traces.solutions[name]
        assert solution.spec.destination_passing_style and solution.spec.binding == "tvm-ffi"
        paths = [source.path for source in solution.sources]
        assert paths[:3] == ["main.cu", "hicache_layout.cuh", "hicache.cuh"]
        assert "jitk/utils.cuh" in paths and "jitk/tensor.h" in paths
        assert f"Transfer::{kind}(" in solution.get_entry_source().content
    k_v = traces.definitions[NAMES["all_layer"]]
    assert list(k_v.inputs) == ["k_cache_dst", "v_cache_dst", "indices_dst", "k_cache_src",
                                "v_cache_src", "indices_src"]
    assert list(k_v.outputs) == ["k_cache_dst_out", "v_cache_dst_out"]
    assert k_v.inputs["k_cache_src"].shape == ["num_layers", "src_slots", "heads", "head_dim"]
    assert k_v.inputs["indices_dst"].dtype == "int64" and k_v.axes["head_dim"].value == 128
    for path in (tmp_path / "solutions" / "kv_transfer").glob("*.json"):  # written JSON
        fib_data.Solution.model_validate(json.loads(path.read_text()))


def _indices(slots: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` distinct slots below `slots`, with two out of range (past the end, negative)."""
    chosen = torch.randperm(slots, generator=generator)[:count]
    chosen[1], chosen[-2] = slots + 3, -1
    return chosen


@pytest.mark.parametrize("kind", fib_hicache.KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_definitions_reference_moves_what_jitks_reference_moves(kind, dtype):
    definition = fib_hicache.definition(kind, dtype=dtype)
    generator = torch.Generator().manual_seed(len(kind))
    row = fib_hicache.DEFAULT_ROWS[kind]
    layers = (3,) if kind.startswith("all_layer") else ()
    caches = 1 if kind.endswith("_mla") else 2
    dst = [torch.randn(*layers, 40, *row, generator=generator).to(dtype) for _ in range(caches)]
    src = [torch.randn(*layers, 50, *row, generator=generator).to(dtype) for _ in range(caches)]
    indices_dst, indices_src = _indices(40, 12, generator), _indices(50, 12, generator)
    got = run_of(definition)(*dst, indices_dst, *src, indices_src)
    got = got if isinstance(got, tuple) else (got,)
    want = [t.clone() for t in dst]
    if not layers:  # a slot is a whole row, heads x head_dim, as the Solution passes it
        (reference.one_layer_reference if caches == 2 else reference.one_layer_mla_reference)(
            *want, indices_dst, *src, indices_src, element_dim=want[0][0].numel())
    else:  # jitk's op takes one base address a layer
        def table(cache):
            return torch.tensor([cache[layer].data_ptr() for layer in range(3)])

        row_bytes = want[0][0, 0].numel() * want[0].element_size()
        strides = dict.fromkeys(["src_stride_bytes", "dst_stride_bytes"], row_bytes)
        prefix = "kv_cache_" if caches == 2 else "cache_"
        (reference.all_layer_reference if caches == 2 else reference.all_layer_mla_reference)(
            *map(table, want), indices_dst, *map(table, src), indices_src,
            num_tokens_dst=40, num_tokens_src=50,
            **{prefix + key: value for key, value in strides.items()})
    assert all(map(torch.equal, got, want))
    assert not any(map(torch.equal, got, dst))  # rows were moved, into copies
    moved = (indices_dst >= 0) & (indices_dst < 40) & (indices_src >= 0) & (indices_src < 50)
    assert int(moved.sum()) == 10  # the two out-of-range pairs moved nothing


def _changed(definition, **fields):
    return fib_data.Definition(**{**definition.model_dump(), **fields})


def test_solution_checks_the_definition_against_the_kernel():
    good = fib_hicache.definition("all_layer")
    assert jitk.fib.solution(good).definition == NAMES["all_layer"]
    dumped = good.model_dump()
    with pytest.raises(ArgumentTypeError, match="must be a flashinfer_bench Definition"):
        jitk.fib.solution(NAMES["all_layer"])
    with pytest.raises(ArgumentError, match=r"inputs \(k_cache_dst, v_cache_dst, indices_dst"):
        jitk.fib.solution(_changed(good, inputs={k: v for k, v in dumped["inputs"].items()
                                                 if k != "v_cache_src"}))
    with pytest.raises(ArgumentTypeError, match="input 'indices_src' is"):
        jitk.fib.solution(_changed(good, inputs={**dumped["inputs"], "indices_src": {
            "shape": ["num_tokens"], "dtype": "int32"}}))
    with pytest.raises(ArgumentError, match="axis 'head_dim'"):
        jitk.fib.solution(_changed(good, axes={**dumped["axes"], "head_dim": {
            "type": "const", "value": 64}}))
    with pytest.raises(ArgumentError, match="its reference differs"):
        jitk.fib.solution(_changed(good, reference=good.reference.replace("< dst_slots",
                                                                          "<= dst_slots")))
    with pytest.raises(ArgumentError, match="is not named jitk_hicache_"):
        jitk.fib.solution(_changed(good, name="jitk_hicache_every_layer_8x128_bfloat16"))
    with pytest.raises(ArgumentError, match="multiple of 16 bytes"):
        fib_hicache.definition("one_layer", (3, 5))


def test_flashinfer_benchs_own_builder_compiles_the_solutions_for_sm90(tmp_path):
    jitk.fib.export(tmp_path / "set", ["transfer_hicache_one_layer",
                                       "transfer_hicache_all_layer_mla"])
    names = [NAMES["one_layer"], NAMES["all_layer_mla"]]
    lines = stock_build(tmp_path, tmp_path / "set", names)
    assert [line.split()[1] for line in lines] == names
    assert all(line.split()[2] == "tvm_ffi" and line.endswith(".so") for line in lines)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", fib_hicache.KINDS)
def test_a_solutions_outputs_equal_its_references_on_the_gpu(kind, monkeypatch):
    from flashinfer_bench.compile import BuilderRegistry

    monkeypatch.setenv("NVCC_APPEND_FLAGS", fib_norm.NVCC_APPEND_FLAGS)  # for its builder
    definition = fib_hicache.definition(kind)
    runnable = BuilderRegistry.get_instance().build(definition, jitk.fib.solution(definition))
    generator = torch.Generator().manual_seed(7)
    row = fib_hicache.DEFAULT_ROWS[kind]
    layers = (4,) if kind.startswith("all_layer") else ()
    caches = 1 if kind.endswith("_mla") else 2
    dst = [torch.randn(*layers, 300, *row, generator=generator).bfloat16().cuda()
           for _ in range(caches)]
    src = [torch.randn(*layers, 500, *row, generator=generator).bfloat16().cuda()
           for _ in range(caches)]
    indices = [_indices(300, 200, generator).cuda(), _indices(500, 200, generator).cuda()]
    inputs = [*dst, indices[0], *src, indices[1]]
    want = run_of(definition)(*inputs)
    want = want if isinstance(want, tuple) else (want,)
    outputs = [torch.full_like(t, float("nan")) for t in dst]
    runnable.call_destination_passing(*inputs, *outputs)
    torch.cuda.synchronize()
    assert all(map(torch.equal, outputs, want))
    assert all(map(torch.equal, inputs[:caches], dst))  # the inputs are left as they were
    runnable.cleanup()
