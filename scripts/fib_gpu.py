"""jitk in FlashInfer-Bench's loop (pip install jitk[fib]).

    python scripts/fib_gpu.py benchmark OUT_DIR     # needs a GPU
    python scripts/fib_gpu.py build-timing          # runs anywhere nvcc does (sm_90)

benchmark: exports the dataset-shaped Definitions of RMSNorm and fused-add RMSNorm
(rmsnorm_h<N>, fused_add_rmsnorm_h<N>, hidden 2048 to 8192) with jitk's Solutions
(python -m jitk fib export), adds workloads (batch sizes below, random inputs) and a torch and a
Triton Solution (scripts/fib_triton.py) of each Definition, and, with jitk's HiCache
transfer Definitions (one-layer and all-layer, K/V and MLA) and Solutions, workloads of
distinct random slots (token counts below, the indices in safetensors files, as random ones
would repeat), then runs flashinfer-bench's own Benchmark on them all. jitk's Solutions are
built by flashinfer-bench's stock tvm-ffi builder (NVCC_APPEND_FLAGS set for it), or by
jitk's with FIB_GPU_BUILDER=jitk. The Traces are written to OUT_DIR/traces; a table of
correctness and speedup is printed, then per Definition family the geometric mean speedup
over the reference of jitk's, torch's and Triton's Solutions. Then the apply() example: a
function decorated with flashinfer_bench.apply("fused_add_rmsnorm_h4096") runs at a
benchmarked batch size (routed to the fastest passing Solution: the table says which) and
at one no trace covers (its own body runs), each checked against the Definition's
reference. Exits 1 unless every jitk trace passed and both apply() calls matched.

build-timing: one tvm-ffi Solution (an RMSNorm written against tvm-ffi's own headers, as
flashinfer-bench's examples are) built by flashinfer-bench's TVMFFIBuilder and by jitk's
builder, each cold (empty caches) and warm (a new process, caches filled), for sm_90. Each
build runs in its own process; the time is the build() call's."""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from fib_triton import triton_solution

import jitk.fib
from jitk.integrations import fib_norm

# flashinfer-bench's benchmark workers are spawned processes that import this file again:
# the builder installed here, at the top level, is installed in them too.
if os.environ.get("FIB_GPU_BUILDER") == "jitk":
    jitk.fib.install_builder()
os.environ.setdefault("NVCC_APPEND_FLAGS", fib_norm.NVCC_APPEND_FLAGS)

from flashinfer_bench.bench import Benchmark, BenchmarkConfig  # noqa: E402
from flashinfer_bench.data import (  # noqa: E402
    Definition,
    EvaluationStatus,
    RandomInput,
    SafetensorsInput,
    Solution,
    Trace,
    TraceSet,
    Workload,
    save_jsonl_file,
)

BATCH_SIZES = (1, 16, 256, 1024, 4096)
OPS = ("rmsnorm", "fused_add_rmsnorm")
HICACHE_TOKENS = (64, 1024, 8192)
# Slots of each side: one layer of a large pool, or a few layers of a smaller one.
HICACHE_AXES = {"one_layer": {"dst_slots": 65536, "src_slots": 65536},
                "all_layer": {"num_layers": 8, "dst_slots": 16384, "src_slots": 16384}}
ARCH = "9.0"

# ------------------------------------------------------------------------------ benchmark
TORCH_SOLUTION = """\
import torch


def run({inputs}):
    x = hidden_states{add}
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps={eps!r})
"""


def torch_solution(definition: Definition) -> Solution:
    """torch.nn.functional.rms_norm as a value-returning Python Solution, for comparison."""
    fused = "residual" in definition.inputs
    eps = fib_norm.signature(definition)[3]
    source = TORCH_SOLUTION.format(inputs=", ".join(definition.inputs),
                                   add=" + residual" if fused else "", eps=eps)
    return Solution(
        name=f"{definition.name}_torch", definition=definition.name, author="fib_gpu.py",
        spec={"language": "python", "target_hardware": ["cuda"], "entry_point": "main.py::run",
              "destination_passing_style": False},
        sources=[{"path": "main.py", "content": source}])


def write_workloads(root: Path) -> None:
    trace_set = TraceSet.from_path(str(root))
    for name, definition in trace_set.definitions.items():
        if definition.op_type != "rmsnorm":
            continue
        traces = [Trace(definition=name, workload=Workload(
            axes={"batch_size": size}, inputs={key: RandomInput() for key in definition.inputs},
            uuid=str(uuid.uuid4()))) for size in BATCH_SIZES]
        save_jsonl_file(traces, root / "workloads" / definition.op_type / f"{name}.jsonl")
        for solution in (torch_solution(definition), triton_solution(definition)):
            path = root / "solutions" / definition.op_type / f"{solution.name}.json"
            path.write_text(solution.model_dump_json(indent=2) + "\n")


def write_hicache_workloads(root: Path) -> None:
    """Each token count's indices: distinct slots of each side, saved beside the workloads."""
    import torch
    from safetensors.torch import save_file

    trace_set = TraceSet.from_path(str(root))
    for name, definition in trace_set.definitions.items():
        if definition.op_type != "kv_transfer":
            continue
        axes = HICACHE_AXES["all_layer" if "num_layers" in definition.axes else "one_layer"]
        traces = []
        (root / "workloads" / definition.op_type).mkdir(parents=True, exist_ok=True)
        for tokens in HICACHE_TOKENS:
            blob = Path("workloads") / definition.op_type / f"{name}_{tokens}.safetensors"
            save_file({"indices_dst": torch.randperm(axes["dst_slots"])[:tokens],
                       "indices_src": torch.randperm(axes["src_slots"])[:tokens]}, root / blob)
            inputs = {key: SafetensorsInput(path=str(blob), tensor_key=key)
                      if key.startswith("indices") else RandomInput()
                      for key in definition.inputs}
            traces.append(Trace(definition=name, workload=Workload(
                axes={**axes, "num_tokens": tokens}, inputs=inputs, uuid=str(uuid.uuid4()))))
        save_jsonl_file(traces, root / "workloads" / definition.op_type / f"{name}.jsonl")


def _size(trace: Trace) -> int:
    """A workload's rows (RMSNorm) or tokens moved (HiCache)."""
    return trace.workload.axes.get("batch_size", trace.workload.axes.get("num_tokens", 0))


def benchmark(out_dir: Path, hidden: list[int]) -> int:
    import torch

    if not torch.cuda.is_available():
        print("benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    jitk.fib.export(out_dir, [*OPS, *jitk.fib.FAMILIES["hicache"]], hidden=hidden)
    write_workloads(out_dir)
    write_hicache_workloads(out_dir)
    trace_set = TraceSet.from_path(str(out_dir))
    bench = Benchmark(trace_set, BenchmarkConfig(warmup_runs=10, iterations=100, num_trials=3))
    try:
        result = bench.run_all(dump_traces=True)
    finally:
        bench.close()
    rows, failed, jitk_traces = [], 0, 0
    for name in sorted(result.traces):
        for trace in sorted(result.traces[name], key=lambda t: (t.solution or "", _size(t))):
            evaluation = trace.evaluation
            passed = evaluation.status == EvaluationStatus.PASSED
            if (trace.solution or "").endswith("_jitk"):
                jitk_traces += 1
                failed += not passed
            performance, correctness = evaluation.performance, evaluation.correctness
            rows.append((name, trace.solution, _size(trace),
                         evaluation.status.value,
                         f"{correctness.max_absolute_error:.3g}" if correctness else "-",
                         f"{performance.latency_ms * 1000:.2f}" if performance else "-",
                         f"{performance.reference_latency_ms * 1000:.2f}" if performance else "-",
                         f"{performance.speedup_factor:.2f}x" if performance else "-"))
    print_table(("definition", "solution", "rows|tokens", "status", "max abs err", "us",
                 "reference us", "speedup"), rows)
    print("geometric mean speedup over the reference, passed workloads:")
    print_table(("family", "solution", "speedup", "passed"),
                summary_rows(trace_set.definitions, result.traces))
    kinds = [d.op_type for d in trace_set.definitions.values()]
    expected = (kinds.count("rmsnorm") * len(BATCH_SIZES)
                + kinds.count("kv_transfer") * len(HICACHE_TOKENS))
    print(f"{jitk_traces} jitk traces of {expected} expected, {failed} not passed; traces in "
          f"{out_dir / 'traces'}")
    applied = apply_example(out_dir)
    return 0 if jitk_traces == expected and not failed and applied else 1


def apply_example(out_dir: Path) -> bool:
    """The guide's apply() example, on the TraceSet the benchmark just wrote."""
    import torch
    from flashinfer_bench import apply, disable_apply, enable_apply
    from flashinfer_bench.apply import ApplyConfigRegistry
    from flashinfer_bench.apply.key import ApplyKey
    from flashinfer_bench.apply.table import ApplyTable

    name = "fused_add_rmsnorm_h4096"
    config = ApplyConfigRegistry(default=jitk.fib.apply_config("bfloat16"))
    trace_set = TraceSet.from_path(str(out_dir))
    table = ApplyTable.load_or_build(trace_set, config)
    reference = {}
    exec(trace_set.definitions[name].reference, reference)  # noqa: S102 - the Definition's

    @apply(name)
    def fused_add_rmsnorm(hidden_states, residual, weight):
        return reference["run"](hidden_states, residual, weight)

    ok = True
    enable_apply(str(out_dir), config)
    try:
        for rows in (BATCH_SIZES[-1], 3):  # benchmarked; covered by no trace
            chosen = table.match_solution(name, ApplyKey(axes=(("batch_size", rows),)))
            x, residual = (torch.randn(rows, 4096, device="cuda").bfloat16() for _ in range(2))
            weight = torch.randn(4096, device="cuda").bfloat16()
            got = fused_add_rmsnorm(x, residual, weight)
            want = reference["run"](x, residual, weight)
            close = torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2)
            print(f"apply({name}) at {rows} rows: {chosen or 'no Solution: fallback'}, "
                  f"{'matches' if close else 'DIFFERS FROM'} the reference")
            ok &= close and (chosen is None if rows == 3 else chosen.endswith("_jitk"))
    finally:
        disable_apply()
    return ok


def family(definition: Definition) -> str:
    """The op a Definition is one size of: its `jitk:<op>` tag (rmsnorm, fused_add_rmsnorm,
    a HiCache transfer)."""
    return next((tag.removeprefix("jitk:") for tag in definition.tags
                 if tag.startswith("jitk:")), definition.name)


def summary_rows(definitions: dict[str, Definition],
                 traces: dict[str, list[Trace]]) -> list[tuple[str, str, str, str]]:
    """Per Definition family and kind of Solution (the name's suffix: jitk, torch, triton):
    the geometric mean of the passed workloads' speedups over the reference, and how many
    of its workloads passed."""
    speedups: dict[tuple[str, str], list[float]] = {}
    counts: dict[tuple[str, str], int] = {}
    for name, definition in definitions.items():
        for trace in traces.get(name, []):
            key = (family(definition), (trace.solution or "").removeprefix(f"{name}_"))
            counts[key] = counts.get(key, 0) + 1
            performance = trace.evaluation.performance
            if (trace.evaluation.status == EvaluationStatus.PASSED and performance
                    and performance.speedup_factor > 0):
                speedups.setdefault(key, []).append(performance.speedup_factor)
    rows = []
    for key in sorted(counts):
        passed = speedups.get(key, [])
        mean = math.exp(sum(map(math.log, passed)) / len(passed)) if passed else None
        rows.append((*key, f"{mean:.2f}x" if mean else "-", f"{len(passed)} of {counts[key]}"))
    return rows


def print_table(header: tuple, rows: list[tuple]) -> None:
    rows = [tuple(map(str, header)), *(tuple(map(str, row)) for row in rows)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


# --------------------------------------------------------------------------- build timing
TVM_FFI_RMSNORM = r"""
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>

#include <cuda_bf16.h>

// One block a row: the sum of squares in float, then the row scaled by the weight.
__global__ void rmsnorm_rows(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y,
                             int hidden, float eps) {
  const __nv_bfloat16* row = x + static_cast<int64_t>(blockIdx.x) * hidden;
  __nv_bfloat16* out = y + static_cast<int64_t>(blockIdx.x) * hidden;
  float sum = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = __bfloat162float(row[i]);
    sum += v * v;
  }
  __shared__ float partial[32];
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x < 32) {
    sum = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.f;
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
    if (threadIdx.x == 0) partial[0] = rsqrtf(sum / hidden + eps);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    out[i] = __float2bfloat16(__bfloat162float(row[i]) * partial[0] * __bfloat162float(w[i]));
  }
}

void run(tvm::ffi::TensorView input, tvm::ffi::TensorView weight, tvm::ffi::TensorView out) {
  const int64_t rows = input.size(0), hidden = input.size(1);
  rmsnorm_rows<<<rows, 256>>>(static_cast<const __nv_bfloat16*>(input.data_ptr()),
                              static_cast<const __nv_bfloat16*>(weight.data_ptr()),
                              static_cast<__nv_bfloat16*>(out.data_ptr()), hidden, 1e-6f);
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, run);
"""


def timing_pair() -> tuple[Definition, Solution]:
    definition = fib_norm.definition("rmsnorm", 4096)
    solution = Solution(
        name="rmsnorm_h4096_tvm_ffi", definition=definition.name, author="fib_gpu.py",
        spec={"language": "cuda", "binding": "tvm-ffi", "target_hardware": ["cuda"],
              "entry_point": "kernel.cu::run"},
        sources=[{"path": "kernel.cu", "content": TVM_FFI_RMSNORM}])
    return definition, solution


def build_once(builder_name: str) -> None:
    """In a child process: one build() call, its seconds printed as JSON."""
    from flashinfer_bench.compile.builders import TVMFFIBuilder

    from jitk.integrations.fib_builder import JitkBuilder

    builder = TVMFFIBuilder() if builder_name == "tvm-ffi" else JitkBuilder()
    definition, solution = timing_pair()
    started = time.perf_counter()
    builder.build(definition, solution)
    print(json.dumps({"seconds": time.perf_counter() - started}))


def build_timing() -> int:
    from jitk.build import toolchain

    rows = []
    with tempfile.TemporaryDirectory(prefix="fib-build-timing-") as scratch:
        for name in ("tvm-ffi", "jitk"):
            env = {**os.environ, "FIB_CACHE_PATH": f"{scratch}/{name}/fib",
                   "JITK_CACHE_DIR": f"{scratch}/{name}/jitk", "JITK_CUDA_ARCH": ARCH,
                   "TVM_FFI_CUDA_ARCH_LIST": ARCH,
                   # the toolkit jitk uses, for both (tvm-ffi links its libcudart)
                   "CUDA_HOME": str(toolchain.cuda_home())}
            times = []
            for _ in ("cold", "warm"):
                child = subprocess.run([sys.executable, __file__, "_build", name], env=env,
                                       capture_output=True, text=True, timeout=900)
                if child.returncode:
                    print(child.stdout, child.stderr, file=sys.stderr)
                    return 1
                times.append(json.loads(child.stdout.strip().splitlines()[-1])["seconds"])
            rows.append((name, f"{times[0]:.2f}", f"{times[1]:.3f}"))
    print(f"one Solution (RMSNorm against tvm-ffi's headers), sm_{ARCH.replace('.', '')}, "
          "seconds in build():")
    print_table(("builder", "cold s", "warm s"), rows)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("benchmark", help="flashinfer-bench's benchmark (needs a GPU)")
    run.add_argument("out_dir", type=Path)
    run.add_argument("--hidden", type=int, nargs="+", default=list(fib_norm.DEFAULT_HIDDEN),
                     help="hidden sizes (default: %(default)s)")
    commands.add_parser("build-timing", help="cold and warm builds by both builders")
    child = commands.add_parser("_build")
    child.add_argument("builder", choices=("tvm-ffi", "jitk"))
    args = parser.parse_args()
    if args.command == "benchmark":
        return benchmark(args.out_dir, args.hidden)
    if args.command == "build-timing":
        return build_timing()
    build_once(args.builder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
