"""jitk.build.nvrtc: device code compiled in the process by NVRTC (the nvidia-cuda-nvrtc
wheel, `pip install 'jitk[nvrtc]'`), template instantiations named by name expressions and
looked up in the cubin by their lowered names. Runs without a GPU."""

import struct

import pytest

from jitk.base.errors import ArgumentError
from jitk.build import nvrtc

try:
    nvrtc.version()
except nvrtc.NvrtcError as error:
    pytest.skip(f"NVRTC is not installed: {error}", allow_module_level=True)

PROBE = r"""
namespace probe {
template <typename T, int kScale>
__global__ void scale(T* data, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) data[i] = data[i] * T(kScale);
}
}  // namespace probe
"""
OPTIONS = ["-arch=sm_90", "-std=c++20"]
EM_CUDA = 190  # the ELF machine of CUDA cubins


def test_name_expressions_lower_to_the_cubins_kernels():
    expressions = ["&probe::scale<float, 2>", "&probe::scale<int, 3>"]
    program = nvrtc.compile_cubin(PROBE, "probe.cu", expressions, OPTIONS)
    # Itanium mangling of each instantiation: what the host side looks the kernel up by
    assert program.lowered == {"&probe::scale<float, 2>": "_ZN5probe5scaleIfLi2EEEvPT_i",
                               "&probe::scale<int, 3>": "_ZN5probe5scaleIiLi3EEEvPT_i"}
    assert program.cubin[:4] == b"\x7fELF"
    assert struct.unpack_from("<H", program.cubin, 18)[0] == EM_CUDA
    for name in program.lowered.values():
        assert name.encode() + b"\0" in program.cubin


def test_a_compile_error_carries_nvrtcs_log():
    broken = PROBE.replace("data[i] * T(kScale)", "data[i] * undeclared")
    with pytest.raises(nvrtc.NvrtcError, match=r"broken\.cu\(6\).*undeclared"):
        nvrtc.compile_cubin(broken, "broken.cu", ["&probe::scale<float, 2>"], OPTIONS)


def test_a_virtual_architecture_is_refused_before_compiling():
    with pytest.raises(ArgumentError, match=r"options=.*-arch=sm_90.*compute_90"):
        nvrtc.compile_cubin(PROBE, "probe.cu", [], ["-arch=compute_90"])


def test_an_unknown_option_names_itself():
    with pytest.raises(nvrtc.NvrtcError, match="--expt-relaxed-constexpr"):
        nvrtc.compile_cubin(PROBE, "probe.cu", [], [*OPTIONS, "--expt-relaxed-constexpr"])
