"""FlashInfer-Bench's stock tvm-ffi builder run on an exported TraceSet folder, in a process
where jitk cannot be imported (as `flashinfer-bench run --local`'s worker), for sm_90."""

import os
import subprocess
import sys
from pathlib import Path

from jitk.build import toolchain
from jitk.integrations import fib_norm

_STOCK_BUILD = """
import sys
sys.modules["jitk"] = None  # the worker has no jitk: importing it would raise
from flashinfer_bench.compile.builders.tvm_ffi_builder import TVMFFIBuilder
from flashinfer_bench.data import TraceSet

traces = TraceSet.from_path(sys.argv[1])
for name in sys.argv[2:]:
    (solution,) = traces.solutions[name]
    built = TVMFFIBuilder().build(traces.definitions[name], solution)
    print("built", name, built.metadata.build_type, built.metadata.misc["binary"])
"""


def stock_build(tmp_path: Path, trace_set: Path, names: list[str]) -> list[str]:
    """Builds each named Definition's one Solution; returns the lines `built NAME tvm_ffi
    BINARY`, one a Definition, or fails with the builder's output."""
    cudart = next(flag[2:] for flag in toolchain.cudart_link_flags() if flag.startswith("-L"))
    env = {**os.environ, "FIB_CACHE_PATH": str(tmp_path / "cache"),
           "TVM_FFI_CUDA_ARCH_LIST": "9.0", "NVCC_APPEND_FLAGS": fib_norm.NVCC_APPEND_FLAGS,
           "CUDA_HOME": str(toolchain.cuda_home()),  # its link step reads CUDA_HOME's lib64
           "LIBRARY_PATH": os.pathsep.join(filter(None, [cudart, os.environ.get(
               "LIBRARY_PATH")]))}
    done = subprocess.run([sys.executable, "-c", _STOCK_BUILD, str(trace_set), *names],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return [line for line in done.stdout.splitlines() if line.startswith("built ")]
