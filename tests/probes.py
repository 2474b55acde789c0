"""Loaders for the probe modules under tests/csrc, shared by several test files."""

import functools
from pathlib import Path

import jitk
from jitk.build import builder, toolchain

CSRC = Path(__file__).resolve().parent / "csrc"
HEADER_PROBE = CSRC / "header_probe.cuh"
LAUNCH_PROBE = CSRC / "launch_probe.cuh"

HEADER_PROBE_FUNCTIONS = (
    "rows_of", "pair", "row_stride", "contiguous_2d", "exactly_4x8", "needs_cuda", "gpu_reachable",
    "shared_dtype_bits", "positive", "always_panics", "print_values", "read_unbound", "helpers",
    "positive_via_helper", "panics_via_helper",
)


@functools.cache
def header_probe(compiler: str):
    """The header probe built by g++ ("cpp"), by nvcc ("cuda"), or as a host half that links
    jitk's host runtime from beside the precompiled prelude ("runtime", jitk/build/pch.py)."""
    wrappers = [(f, f"probe::{f}") for f in HEADER_PROBE_FUNCTIONS]
    if compiler == "cpp":
        return jitk.load_jit("header_probe", "cpp", cpp_files=[HEADER_PROBE], cpp_wrappers=wrappers)
    if compiler == "runtime":
        builder.build_prelude(toolchain.canonical_archs(toolchain.target_archs()))
        return jitk.load_jit("header_probe", "runtime", cuda_files=[HEADER_PROBE],
                             cuda_wrappers=wrappers, cuda_compiler="nvrtc")
    return jitk.load_jit("header_probe", "cuda", cuda_files=[HEADER_PROBE], cuda_wrappers=wrappers)


@functools.cache
def launch_probe():
    return jitk.load_jit("launch_probe", cuda_files=[LAUNCH_PROBE],
                         cuda_wrappers=[("add_one", "launch_probe::add_one")])


def line_of(path: Path, marker: str) -> str:
    """'file.cuh:LINE' of the line carrying `// at:marker`."""
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.rstrip().endswith(f"// at:{marker}"):
            return f"{path.name}:{number}"
    raise AssertionError(f"no '// at:{marker}' in {path}")
