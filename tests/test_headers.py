"""Every TensorMatcher rule and every utils.h facility, through a probe module built with
g++, with nvcc, and as a host half linking jitk's host runtime (JITK_RUNTIME), called with CPU
tensors from torch and numpy."""

import functools
import re

import numpy as np
import pytest
import torch
from errors import expect_error
from probes import CSRC, HEADER_PROBE, LAUNCH_PROBE, header_probe, line_of

import jitk
from jitk.build.jit import INCLUDE_DIR, KERNEL_DIR


@pytest.fixture(params=["cpp", "cuda", "runtime"], scope="module")
def probe(request):
    return header_probe(request.param)


def at(marker):
    return line_of(HEADER_PROBE, marker)


def test_matching_tensor_binds_symbols(probe):
    assert probe.rows_of(torch.randn(10, 128), 128) == 10
    assert probe.pair(torch.randn(6, 32), torch.randn(6, 32)) == 6032
    assert probe.pair(torch.randn(6, 32, dtype=torch.float64),
                      torch.randn(6, 32, dtype=torch.float64)) == 6032


def test_size_mismatch_message_names_tensor_dimension_and_line(probe):
    message = expect_error(lambda: probe.rows_of(torch.randn(10, 64), 128))
    assert message == (
        "Tensor match failed for 'x' Tensor<10, 64>[strides=<64, 1>, dtype=float32, "
        f"device=cpu] at {at('rows')} - Root cause: Size mismatch for shape#1('head_dim'): "
        "expected 128 but got 64"
    )


def test_symbol_bound_by_first_tensor_checks_the_second(probe):
    expect_error(lambda: probe.pair(torch.randn(6, 32), torch.randn(5, 32)), "'b' Tensor<5, 32>",
                 "Size mismatch for shape#0('num_tokens'): expected 6 but got 5")


def test_ndim_mismatch(probe):
    expect_error(lambda: probe.rows_of(torch.randn(3, 128, 1), 128),
                 "Dimension mismatch: expected 2 dims but got 3", at("rows"))


def test_fixed_sizes(probe):
    probe.exactly_4x8(torch.randn(4, 8))
    expect_error(lambda: probe.exactly_4x8(torch.randn(4, 9)),
                 "Size mismatch for shape#1: expected 8 but got 9", at("fixed"))


def test_any_size_and_contiguity(probe):
    probe.contiguous_2d(torch.randn(3, 5))
    expect_error(lambda: probe.contiguous_2d(torch.randn(5, 3).t()),
                 "Stride mismatch for stride#1: expected 1 (contiguous) but got 3", at("contig"))
    expect_error(lambda: probe.contiguous_2d(torch.randn(4, 6)[:, :3]),
                 "Stride mismatch for stride#0: expected 3 (contiguous) but got 6")


def test_size_one_dimension_stride_is_not_checked(probe):
    column = torch.randn(7, 1).as_strided((7, 1), (1, 99))
    probe.contiguous_2d(column)
    row = torch.randn(1, 7).as_strided((1, 7), (1000, 1))
    probe.contiguous_2d(row)


def test_empty_tensor_strides_are_not_checked(probe):
    probe.contiguous_2d(torch.empty(0, 5).as_strided((0, 5), (1, 9)))


def test_with_strides_binds_row_stride(probe):
    wide = torch.randn(10, 256)
    assert probe.row_stride(wide[:, :128]) == 256
    assert probe.row_stride(torch.randn(10, 128)) == 128
    expect_error(lambda: probe.row_stride(wide[:, :128].t()),
                 "Stride mismatch for stride#1: expected 1 but got 256", at("strided"))


def test_dtype_not_allowed(probe):
    expect_error(lambda: probe.rows_of(torch.randn(2, 4).half(), 4),
                 "DType mismatch: expected float32 but got float16")
    expect_error(lambda: probe.pair(torch.randn(2, 4).half(), torch.randn(2, 4).half()),
                 "DType mismatch: expected one of [float32, float64, int32] but got float16")


def test_dtype_symbol_shared_across_tensors_and_matchers(probe):
    expect_error(lambda: probe.pair(torch.randn(2, 4), torch.randn(2, 4, dtype=torch.float64)),
                 "'b'", "DType mismatch for 'cache dtype': expected float32", "but got float64")
    assert probe.shared_dtype_bits(torch.randn(3), torch.randn(2, 2)) == 32
    assert probe.shared_dtype_bits(torch.randn(3).double(), torch.randn(2, 2).double()) == 64
    expect_error(lambda: probe.shared_dtype_bits(torch.randn(3), torch.randn(2, 2).double()),
                 "'b'", "expected float32", "but got float64", at("shared"))


def test_device_mismatch_names_devices(probe):
    expect_error(lambda: probe.needs_cuda(torch.randn(3)),
                 "'x' Tensor<3>[strides=<1>, dtype=float32, device=cpu]",
                 "Device mismatch: expected cuda but got cpu", at("cuda"))


def test_numpy_arrays_arrive_through_dlpack(probe):
    x = np.random.default_rng(0).random((7, 128), dtype=np.float32)
    assert probe.rows_of(x, 128) == 7
    expect_error(lambda: probe.rows_of(x.astype(np.float64), 128),
                 "DType mismatch: expected float32 but got float64")
    expect_error(lambda: probe.contiguous_2d(np.asfortranarray(np.ones((3, 4), np.float32) * 2)),
                 "Stride mismatch")


def test_list_of_device_kinds(probe):
    expect_error(lambda: probe.gpu_reachable(torch.randn(3)), "'x'",
                 "Device mismatch: expected one of [cuda, cuda_host] but got cpu")


@pytest.mark.gpu
def test_device_symbol_binds_the_first_tensors_device(probe):
    expect_error(lambda: probe.pair(torch.randn(6, 32), torch.randn(6, 32, device="cuda")), "'b'",
                 "Device mismatch for 'cache device': expected cpu (as an earlier tensor) but "
                 "got cuda:0")


def test_runtime_check_and_panic_name_the_caller(probe):
    assert probe.positive(5) == 5
    message = expect_error(lambda: probe.positive(0))
    assert message == f"Runtime check failed at {at('check')}: n must be positive, got 0"
    message = expect_error(lambda: probe.always_panics(7))
    assert message == f"Panic at {at('panic')}: gave up with code 7"


def test_helpers_check_on_behalf_of_their_caller(probe):
    assert probe.positive_via_helper(3) == 3
    message = expect_error(lambda: probe.positive_via_helper(0))
    assert message == f"Runtime check failed at {at('helper_check')}: n must be positive, got 0"
    message = expect_error(lambda: probe.panics_via_helper(4))
    assert message == f"Panic at {at('helper_panic')}: gave up for the caller with code 4"


def test_message_arguments_of_every_kind(probe):
    message = expect_error(lambda: probe.print_values(-42, 0.125, True))
    assert message == (
        f"Panic at {at('values')}: n=-42 x=0.125 flag=true c=c small=-5 "
        "big=18446744073709551615 hex=0xff std::string string_view dtype=uint16 "
        f"device=cuda:3 mode=3 t=21.5 C at={at('values')}"
    )


def test_unprintable_message_argument_fails_to_compile_with_a_clear_error(tmp_path):
    kernel = tmp_path / "unprintable.cuh"
    kernel.write_text(
        "#include <jitk/utils.h>\n"
        "struct Opaque {};\n"
        "void fails() { jitk::Panic(\"got \", Opaque{}); }\n"
    )
    with pytest.raises(jitk.JitCompileError) as info:
        jitk.load_jit("unprintable", cpp_files=[kernel], cpp_wrappers=[("fails", "fails")],
                      build_directory=tmp_path / "build")
    assert "jitk: a message argument has a type jitk cannot print" in str(info.value)


def test_unwrap_of_unbound_symbol(probe):
    expect_error(lambda: probe.read_unbound(), f"Panic at {at('unwrap')}: symbol 'never bound' "
                 "was read before any tensor bound it")


def test_irange_div_ceil_and_pointer_offset(probe):
    for n in (0, 1, 10, 13):
        expected = sum(range(n)) + 100 * (2 + 3 + 4) + 10000 * -(-n // 4) + 1000000 * 24
        assert probe.helpers(n) == expected


def test_error_location_is_a_real_line(probe):
    # The marker lines really hold the calls: a stale marker would make the other tests lie.
    for marker in ("rows", "check", "panic", "values", "unwrap", "cuda", "strided", "fixed",
                   "contig"):
        line = int(at(marker).split(":")[1])
        text = HEADER_PROBE.read_text().splitlines()[line - 1]
        assert re.search(r"verify|RuntimeCheck|Panic|unwrap|DebugInfo", text), text


def test_wrong_argument_types_and_counts_are_python_type_errors(probe):
    expect_error(lambda: probe.positive("five"), "argument 0: expected an int, got str",
                 kind=TypeError)
    expect_error(lambda: probe.rows_of(5, 128), "argument 0: expected a tensor, got int",
                 kind=TypeError)
    expect_error(lambda: probe.positive(1, 2), "positive() takes 1 arguments but 2 were given",
                 kind=TypeError)
    expect_error(lambda: probe.positive(2**70), kind=Exception)  # too big for int64 anywhere
    assert probe.positive(True) == 1  # a bool is an int, as in Python


# ---------------------------------------------------------------------------------------
# Kernels written for tvm-ffi: its headers, types and errors cross jitk's export boundary.

TVM_FFI_PROBE = CSRC / "tvm_ffi_probe.cuh"
TVM_FFI_FUNCTIONS = ("sum", "numel_or", "describe", "refuse", "rows_of_both", "sglang_style")


@functools.cache
def tvm_ffi_probe(compiler):
    wrappers = [(f, f"tvm_ffi_probe::{f}") for f in TVM_FFI_FUNCTIONS]
    if compiler == "cpp":
        return jitk.load_jit("tvm_ffi_probe", "cpp", cpp_files=[TVM_FFI_PROBE],
                             cpp_wrappers=wrappers)
    wrappers.append(("add_one", "tvm_ffi_probe::AddOne::run"))
    return jitk.load_jit("tvm_ffi_probe", "cuda", cuda_files=[TVM_FFI_PROBE],
                         cuda_wrappers=wrappers)


@pytest.fixture(params=["cpp", "cuda", "runtime"], scope="module")
def tvm_probe(request):
    return tvm_ffi_probe(request.param)


def test_tvm_ffi_types_cross_the_boundary(tvm_probe):
    assert tvm_probe.sum(torch.arange(5, dtype=torch.float32)) == 10
    assert tvm_probe.sum(torch.arange(10, dtype=torch.float32)[::2]) == 20
    assert tvm_probe.numel_or(torch.ones(2, 3), 7) == 6
    assert tvm_probe.numel_or(None, 7) == 7  # an empty tvm::ffi::Optional
    assert tvm_probe.describe(torch.ones(2, 3)) == "2-d on device type 1"  # a tvm::ffi::String
    assert tvm_probe.rows_of_both(torch.ones(4, 2), torch.ones(4, 5)) == 4
    assert tvm_probe.sglang_style(torch.ones(3, 5), torch.ones(3, 5)) == 15


def test_jitk_matchers_take_tvm_ffi_views_as_they_are(tvm_probe):
    """TensorMatcher::verify on a tvm::ffi::TensorView or Tensor, unconverted, as SGLang's
    kernels call it: the same checks and messages as on a jitk::TensorView."""
    expect_error(lambda: tvm_probe.sglang_style(torch.ones(3, 5), torch.ones(3, 4)),
                 "Tensor match failed for Tensor<3, 4>",
                 "Size mismatch for shape#1('cols'): expected 5 but got 4")
    expect_error(lambda: tvm_probe.sglang_style(torch.ones(3, 5, dtype=torch.float64),
                                                torch.ones(3, 5)),
                 line_of(TVM_FFI_PROBE, "sglang"), "DType mismatch")


def test_tvm_ffi_errors_keep_their_kind(tvm_probe):
    expect_error(lambda: tvm_probe.refuse(3), "refused code 3", kind=ValueError)
    expect_error(lambda: tvm_probe.sum(torch.ones(2, 2)), "sum takes a 1-d float32 tensor",
                 kind=TypeError)
    expect_error(lambda: tvm_probe.sum(5), "argument 0: expected DLTensor*, got int",
                 kind=TypeError)
    expect_error(lambda: tvm_probe.numel_or("x", 7),
                 "argument 0: expected Optional<ffi.Tensor>, got str", kind=TypeError)
    # jitk's matcher on a tvm-ffi tensor names it and the kernel's line.
    expect_error(lambda: tvm_probe.rows_of_both(torch.ones(4, 2), torch.ones(3, 5)),
                 "'b' Tensor<3, 5>", line_of(TVM_FFI_PROBE, "b"),
                 "Size mismatch for shape#0('rows'): expected 4 but got 3")


def test_a_tvm_ffi_style_cuda_kernel_builds_for_sm90():
    module = tvm_ffi_probe("cuda")
    expect_error(lambda: module.add_one(torch.ones(3), torch.ones(3)), "'in'",
                 "Device mismatch: expected cuda but got cpu", line_of(TVM_FFI_PROBE, "add_one"))


@pytest.mark.gpu
def test_a_tvm_ffi_style_cuda_kernel_runs():
    x = torch.randn(1000, device="cuda")
    y = torch.full_like(x, float("nan"))
    tvm_ffi_probe("cuda").add_one(y, x)
    assert torch.equal(y, x + 1)


def test_only_modules_that_include_tvm_ffi_parse_its_headers(tmp_path):
    """The generated source includes jitk/tvm_ffi_types.h for every module, but a kernel
    without tvm-ffi's C++ headers compiles none of them (nvcc's record of the headers)."""
    def headers_read(name, kernel, wrapper):
        build = tmp_path / name
        jitk.load_jit(name, cuda_files=[kernel], cuda_wrappers=[("f", wrapper)],
                      build_directory=build)
        return (build / "cuda.o.d").read_text()

    plain = headers_read("plain", LAUNCH_PROBE, "launch_probe::add_one")
    assert "jitk/tvm_ffi_types.h" in plain
    assert "tvm/ffi/type_traits.h" not in plain and "tvm/ffi/c_api.h" in plain
    with_tvm_ffi = headers_read("with_tvm_ffi", TVM_FFI_PROBE, "tvm_ffi_probe::AddOne::run")
    assert "tvm/ffi/type_traits.h" in with_tvm_ffi


def test_only_the_preludes_headers_hold_runtime_functions():
    """A host half built with the prelude links the runtime compiled from jitk/host_prelude.h
    alone: a JITK_RUNTIME function in any header it does not include (or in a kernel file)
    would be declared there and defined nowhere."""
    include = INCLUDE_DIR
    reached, todo = set(), [include / "jitk" / "host_prelude.h"]
    while todo:
        header = todo.pop()
        if header not in reached:
            reached.add(header)
            todo += [include / name for name in
                     re.findall(r"#include <(jitk/[\w.]+)>", header.read_text())]
    users = {path for folder in (include, KERNEL_DIR) for path in folder.rglob("*")
             if path.suffix in (".h", ".cuh") and "JITK_RUNTIME_BODY" in path.read_text()}
    assert {p.name for p in users} >= {"nvrtc.cuh", "tensor.h", "export.h", "rows.h"}
    assert users - {include / "jitk" / "utils.h"} <= reached
