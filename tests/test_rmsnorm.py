"""jitk.kernels.norm: rmsnorm and fused_add_rmsnorm (python/jitk/kernels/norm/rmsnorm.cuh).

Without a GPU the module is built for sm_90 and every check of the host entry points runs:
CPU tensors are refused, and tensors that only claim to live on a GPU (DLPack views of a
made-up address, never read) reach the checks behind the device check. On a GPU the
kernels are compared with a float64 reference on fresh random data, outputs poisoned with
NaN before each run."""

import ctypes
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
import tvm_ffi

import jitk
from jitk.build import cache
from jitk.kernels import norm
from jitk.kernels.norm import tuning

HAS_GPU = torch.cuda.is_available()
LOCATION = re.compile(r"rmsnorm\.cuh:\d+")
TOLERANCES = {  # (rtol, atol): one unit in the last place of the output dtype, and margin
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1e-2, 1e-2),
}


# ---------------------------------------------------------------------------------------
# Tensors that claim to be on cuda:0 without a GPU.

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]  # none: the memory below lives in _ALIVE


_DL_CODES = {torch.float32: (2, 32), torch.float16: (2, 16), torch.bfloat16: (4, 16),
             torch.int32: (0, 32)}
_ALIVE = []
_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class _ClaimsCuda:
    """A DLPack producer whose tensor says cuda:0; its address is never read."""

    def __init__(self, shape, strides, dtype, address):
        self.shape = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self.strides = (ctypes.c_int64 * max(len(shape), 1))(*strides)
        self.managed = _DLManagedTensor()
        code, bits = _DL_CODES[dtype]
        self.managed.dl_tensor = _DLTensor(address, _DLDevice(2, 0), len(shape),
                                           _DLDataType(code, bits, 1), self.shape, self.strides, 0)

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, **kwargs):
        return _PyCapsule_New(ctypes.addressof(self.managed), b"dltensor", None)


def fake_cuda(shape, dtype=torch.bfloat16, strides=None, offset_elements=0):
    """A tensor on 'cuda:0' of `shape` (contiguous unless `strides`), at an address that is
    16-byte aligned plus `offset_elements`."""
    if strides is None:
        strides, step = [], 1
        for size in reversed(shape):
            strides.insert(0, step)
            step *= size
    element = _DL_CODES[dtype][1] // 8
    producer = _ClaimsCuda(shape, strides, dtype, (1 << 30) + offset_elements * element)
    _ALIVE.append(producer)
    return tvm_ffi.from_dlpack(producer)


def kernels():
    """The module the CPU tests share: hidden size 128, bfloat16."""
    return norm.default_kernels(128, torch.bfloat16)


def failure(call, *args):
    with pytest.raises(RuntimeError) as info:
        call(*args)
    message = str(info.value)
    assert LOCATION.search(message), message
    return message


# ---------------------------------------------------------------------------------------
# Without a GPU: the module builds, and every check says precisely what is wrong.

def test_cpu_tensors_are_refused():
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    w = torch.randn(128, dtype=torch.bfloat16)
    for call in (lambda: norm.rmsnorm(x, w), lambda: norm.rmsnorm(x, w, out=torch.empty_like(x)),
                 lambda: norm.fused_add_rmsnorm(x, x.clone(), w)):
        message = failure(call)
        assert "Tensor match failed for 'input' Tensor<4, 128>" in message
        assert "Device mismatch: expected cuda but got cpu" in message


def test_unsupported_dtypes_and_sizes_are_refused_before_building():
    with pytest.raises(TypeError, match="float32, float16 and bfloat16.*torch.float64"):
        norm.rmsnorm(torch.randn(4, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64))
    with pytest.raises(TypeError, match="torch.int32"):
        norm.fused_add_rmsnorm(torch.ones(4, 8, dtype=torch.int32),
                               torch.ones(4, 8, dtype=torch.int32),
                               torch.ones(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="hidden size .* got 0"):
        norm.rmsnorm(torch.empty(4, 0, dtype=torch.bfloat16), torch.empty(0, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="'input' is a 0-d tensor"):
        norm.rmsnorm(torch.tensor(1.5), torch.ones(1))
    with pytest.raises(ValueError, match="'input' is a 0-d tensor"):
        norm.fused_add_rmsnorm(torch.tensor(1.5), torch.tensor(1.0), torch.ones(1))


def test_out_must_match_the_input():
    k, x, w = kernels(), fake_cuda((4, 128)), fake_cuda((128,))
    message = failure(k.rmsnorm, x, w, fake_cuda((5, 128)), 1e-6)
    assert "'out'" in message
    assert "Size mismatch for shape#0('rows'): expected 4 but got 5" in message
    message = failure(k.rmsnorm, x, w, fake_cuda((4, 64)), 1e-6)
    assert "Size mismatch for shape#1('hidden size'): expected 128 but got 64" in message
    message = failure(k.rmsnorm, x, w, fake_cuda((4, 128), torch.float16), 1e-6)
    assert "'out'" in message and "DType mismatch: expected bfloat16 but got float16" in message
    message = failure(k.rmsnorm, x, w, torch.empty(4, 128, dtype=torch.bfloat16), 1e-6)
    assert "'out'" in message and "Device mismatch" in message
    message = failure(k.rmsnorm, x, w, fake_cuda((4, 128), strides=(256, 2)), 1e-6)
    assert "'out'" in message and "Stride mismatch for stride#1" in message
    message = failure(k.rmsnorm, x, w, fake_cuda(()), 1e-6)
    assert "'out' must have at least one dimension" in message


def test_weight_must_be_contiguous_hidden_size_and_input_dtype():
    k, x = kernels(), fake_cuda((4, 128))
    message = failure(k.rmsnorm, x, fake_cuda((64,)), x, 1e-6)
    assert "'weight'" in message and "('hidden size'): expected 128 but got 64" in message
    message = failure(k.rmsnorm, x, fake_cuda((128,), torch.float32), x, 1e-6)
    assert "'weight'" in message and "DType mismatch: expected bfloat16 but got float32" in message
    message = failure(k.rmsnorm, x, fake_cuda((1, 128)), x, 1e-6)
    assert "'weight'" in message and "expected 1 dims but got 2" in message
    message = failure(k.rmsnorm, x, fake_cuda((128,), strides=(2,)), x, 1e-6)
    assert "'weight'" in message and "Stride mismatch" in message


def test_leading_dimensions_must_collapse_into_two_row_strides():
    k, w = kernels(), fake_cuda((128,))
    # [2, 3, 4, 128] cut from [2, 5, 6, 128]: three runs of rows, one stride too many.
    x = fake_cuda((2, 3, 4, 128), strides=(5 * 6 * 128, 6 * 128, 128, 1))
    message = failure(k.rmsnorm, x, w, x, 1e-6)
    assert "'input' Tensor<2, 3, 4, 128>" in message
    assert "do not collapse into two row strides" in message
    assert "stride#0 is 3840, not 2304" in message


def test_heads_of_a_fused_qkv_buffer_pass_every_check():
    """[tokens, heads, head_dim] cut from [tokens, qkv_width]: two row strides, each operand
    with its own. Without a driver the launch itself fails: every check before it passed."""
    if HAS_GPU:
        pytest.skip("would launch on a made-up address")
    k, w = kernels(), fake_cuda((128,))
    q = fake_cuda((5, 4, 128), strides=(12 * 128, 128, 1))
    k_heads = fake_cuda((5, 4, 128), strides=(12 * 128, 128, 1), offset_elements=4 * 128)
    transposed = fake_cuda((5, 4, 128), strides=(128, 5 * 128, 1))  # heads-major memory
    for out in (fake_cuda((5, 4, 128)), fake_cuda((20, 128)), k_heads, transposed, q):
        assert "CUDA error" in failure(k.rmsnorm, q, w, out, 1e-6)
        assert "CUDA error" in failure(k.fused_add_rmsnorm, q, out, w, 1e-6)
    misaligned = fake_cuda((5, 4, 128), strides=(12 * 128 + 1, 128, 1), offset_elements=1)
    assert "CUDA error" in failure(k.fused_add_rmsnorm, misaligned, q, w, 1e-6)


def test_strided_heads_must_agree_on_their_rows():
    k, w = kernels(), fake_cuda((128,))
    q = fake_cuda((5, 4, 128), strides=(12 * 128, 128, 1))
    message = failure(k.rmsnorm, q, w, fake_cuda((4, 5, 128), strides=(12 * 128, 128, 1)), 1e-6)
    assert "'out' and 'input' group their rows differently (runs of 5 and of 4 rows)" in message
    message = failure(k.rmsnorm, q, w, fake_cuda((5, 3, 128), strides=(12 * 128, 128, 1)), 1e-6)
    assert "'out'" in message and "('rows'): expected 20 but got 15" in message


ROW_SPLIT_PROBE = Path(__file__).resolve().parent / "csrc" / "row_split_probe.cpp"


def test_row_split_divides_exactly():
    """The kernel finds a strided row's run and place in it by a multiply-high and a shift
    (rows.h RowSplit) when rows fit in 32 bits, by a 64-bit division beyond: checked on the
    host against plain division next to every multiple of the run length (where a wrong
    magic number shows first), over the first and the last million rows."""
    probe = jitk.load_jit("row_split_probe", cpp_files=[ROW_SPLIT_PROBE],
                          cpp_wrappers=[("first_wrong_row", "row_split_probe::first_wrong_row")])
    narrow = 2**32 - 1  # the most rows that take the multiply-high
    divisors = [1, 2, 3, 5, 6, 7, 24, 32, 48, 641, 65537, 6700417, 2**31 - 1, 2**31, 2**31 + 1,
                narrow - 1, narrow]
    for rows, divisor in [(narrow, d) for d in divisors] + [(2**40, 3), (2**33 + 5, 2**32 + 1)]:
        for first in (divisor - 1, divisor, divisor + 1):
            wrong = probe.first_wrong_row(divisor, rows, first, 2_000_000, divisor)
            assert wrong == -1, (divisor, rows, wrong)
        for first in (0, rows - 2**20):
            wrong = probe.first_wrong_row(divisor, rows, first, 2**20, 1)
            assert wrong == -1, (divisor, rows, wrong)


def test_written_heads_must_not_overlap():
    k, w = kernels(), fake_cuda((128,))
    q = fake_cuda((5, 4, 128), strides=(12 * 128, 128, 1))
    # Each token's heads reach 512 elements, but tokens are only 256 apart.
    overlapping = fake_cuda((5, 4, 128), strides=(256, 128, 1))
    message = failure(k.rmsnorm, q, w, overlapping, 1e-6)
    assert ("rows of 'out' overlap in memory (rows of 128 at strides 256 and 128, in runs of "
            "4), so writing them would race") in message
    message = failure(k.fused_add_rmsnorm, overlapping, q, w, 1e-6)
    assert "rows of 'input' overlap" in message
    k.rmsnorm(fake_cuda((0, 4, 128), strides=(256, 128, 1)), w, fake_cuda((0, 128)), 1e-6)


def test_last_dimension_must_be_contiguous():
    k, w = kernels(), fake_cuda((128,))
    x = fake_cuda((4, 128), strides=(1, 4))
    message = failure(k.rmsnorm, x, w, x, 1e-6)
    assert "'input'" in message and "Stride mismatch for stride#1" in message


def test_written_rows_must_not_overlap():
    k, w = kernels(), fake_cuda((128,))
    overlapping = fake_cuda((4, 128), strides=(64, 1))
    message = failure(k.rmsnorm, fake_cuda((4, 128)), w, overlapping, 1e-6)
    assert "rows of 'out' overlap in memory (row stride 64 < hidden size 128)" in message
    message = failure(k.fused_add_rmsnorm, fake_cuda((4, 128)), overlapping, w, 1e-6)
    assert "rows of 'residual' overlap" in message
    broadcast = fake_cuda((4, 128), strides=(0, 1))
    message = failure(k.fused_add_rmsnorm, broadcast, fake_cuda((4, 128)), w, 1e-6)
    assert "rows of 'input' overlap" in message


def test_fused_add_checks_the_residual():
    k, x, w = kernels(), fake_cuda((4, 128)), fake_cuda((128,))
    message = failure(k.fused_add_rmsnorm, x, fake_cuda((3, 128)), w, 1e-6)
    assert "'residual'" in message and "('rows'): expected 4 but got 3" in message
    message = failure(k.fused_add_rmsnorm, x, fake_cuda((4, 128), torch.float32), w, 1e-6)
    assert "'residual'" in message and "expected bfloat16 but got float32" in message


def test_eps_must_be_finite_and_non_negative():
    k, x, w = kernels(), fake_cuda((4, 128)), fake_cuda((128,))
    for eps in (-1.0, float("nan"), float("inf"), 1e300, -1e300):
        assert "eps must be finite and >= 0" in failure(k.rmsnorm, x, w, x, eps)
        assert "eps must be finite and >= 0" in failure(k.fused_add_rmsnorm, x, x, w, eps)


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A cache folder of its own: a test that must build nothing checks it stays empty."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("JITK_CACHE_DIR", str(cache))
    yield cache
    assert not cache.exists() or not any(cache.iterdir()), list(cache.iterdir())


def test_bad_values_are_refused_before_any_build(empty_cache):
    x, w = torch.randn(4, 96, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    for eps in (1e300, -1e-6, float("nan"), float("inf"), 3.5e38):
        with pytest.raises(ValueError, match=r"rmsnorm: 'eps' must be finite and >= 0 as a "
                                             r"float32 .* got " + re.escape(repr(eps))):
            norm.rmsnorm(x, w, eps=eps)
        with pytest.raises(ValueError, match="fused_add_rmsnorm: 'eps'"):
            norm.fused_add_rmsnorm(x, x.clone(), w, eps=eps)
    for hidden in (2**31 - 1, 2**30 + 1):
        wide = torch.empty(1, 1, dtype=torch.bfloat16).expand(1, hidden)  # no memory
        with pytest.raises(ValueError, match=f"hidden size .* 1 to 1073741824, got {hidden}"):
            norm.rmsnorm(wide, w)
        with pytest.raises(ValueError, match=f"got {hidden}"):
            norm.fused_add_rmsnorm(wide, wide, w)


def test_float_sum_must_be_a_bool_and_keyword(empty_cache):
    x, w = torch.randn(4, 96, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="float_sum"):
        norm.fused_add_rmsnorm(x, x.clone(), w, 1e-6, float_sum=1)
    with pytest.raises(TypeError):
        norm.fused_add_rmsnorm(x, x.clone(), w, 1e-6, True)  # keyword-only


def test_float_sum_builds_a_module_of_its_own(tmp_path, monkeypatch):
    """The stored-sum module holds no float_sum kernel (the common modules build none of
    its kernels); asking for it builds a module of the fused form alone, from the same
    tuning, whose entry point checks its tensors as the stored-sum form does."""
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    kernels = norm.default_kernels(256, torch.float16)
    assert not any("float_sum" in p.name for p in tmp_path.iterdir())
    float_sum = kernels.fused_add_rmsnorm_float_sum()
    assert float_sum is kernels.fused_add_rmsnorm_float_sum()  # built once
    built = [p.name for p in tmp_path.iterdir() if p.is_dir() and "float_sum" in p.name]
    assert len(built) == 1 and built[0].startswith("rmsnorm_float_sum_256_fp16_t"), built
    x, w = fake_cuda((4, 256), torch.float16), fake_cuda((256,), torch.float16)
    message = failure(float_sum, x, fake_cuda((3, 256), torch.float16), w, 1e-6)
    assert "'residual'" in message and "('rows'): expected 4 but got 3" in message


def test_a_float_sum_call_builds_only_its_own_module(tmp_path, monkeypatch):
    """The public call with float_sum builds the float_sum module of its bucket's choice, not
    the stored-sum module beside it (the kernel then refuses CPU tensors)."""
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    x = torch.randn(4, 384, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="expected cuda but got cpu"):
        norm.fused_add_rmsnorm(x, x.clone(), torch.randn(384, dtype=torch.float16),
                               float_sum=True)
    built = [p.name for p in tmp_path.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(built) == 1 and built[0].startswith("rmsnorm_float_sum_384_fp16_t"), built


def test_the_largest_hidden_size_builds():
    """norm.MAX_HIDDEN is the kernel's kMaxHidden: the largest size builds (one more is
    refused above), and a row of it is indexed without overflow in the kernel's ints."""
    k = norm.default_kernels(norm.MAX_HIDDEN, torch.bfloat16)
    x = fake_cuda((1, norm.MAX_HIDDEN))
    message = failure(k.rmsnorm, x, fake_cuda((128,)), x, 1e-6)
    assert "'weight'" in message and "expected 1073741824 but got 128" in message


# The kernels known to spill, both at 4096 (128 threads), where the tuner times them as they
# are (on an H100 neither won a 4096 bucket): the short path with the late launch and the
# loop, 48-72 bytes under the 8-block register cap (64 a thread; 88-106 uncapped); and the
# short path with four sums and fill_sm, 8 bytes, which a larger plan would cost a block an
# SM at 12288, where it wins (rmsnorm_kernels.cuh, fill_sm_blocks).
KNOWN_SPILLS = (4096, {**tuning._SHORT_PATH, **tuning._LATE}), (
    4096, {**tuning._SHORT_PATH, **tuning._FOUR_SUMS, **tuning._FILL_SM, **tuning._ONE_TURN})


# The kernels' forms (kFusedAdd, kFloatSum): plain, fused, fused with float_sum.
FORMS = ("false, false", "true, false", "true, true")


def _spill_check_sources(parts: int) -> list[str]:
    """Every kernel a module of the benchmark's widths holds, instantiated alone: the default's
    four (plain rows or two runs, widest vectors or one element) and each candidate's plain-rows
    kernel, in both 16-bit dtypes, plain, fused and fused with float_sum; dealt over `parts`
    sources, which build side by side."""
    from jitk.build.cpp_args import make_cpp_args

    lines, kernels = ["#include <norm/rmsnorm.cuh>", "using namespace jitk::norm;"], []
    for hidden in sorted({hidden for _, hidden in norm.RMSNORM_SPACE.shapes}):
        for dtype, name in ((torch.bfloat16, "jitk::bf16_t"), (torch.float16, "jitk::fp16_t")):
            default = norm.default_knobs((hidden, dtype))
            for i, knobs in enumerate((default, *tuning.candidates(hidden, dtype))):
                if any((hidden, knobs) == (width, {**default, **changes})
                       for width, changes in KNOWN_SPILLS):
                    continue
                tune = f"Tu_{hidden}_{name[6:]}_{i}"
                lines.append(f"using {tune} = Tuning<{make_cpp_args(*tuning.knob_values(knobs))}>;")
                if knobs["two_vectors"]:  # its own kernel, in place of the candidate's
                    kernels += [f"(void*)&rmsnorm_two_vectors_kernel<{hidden}, {name}, {form}, "
                                f"{tune}::kLateTrigger>" for form in FORMS]
                    continue
                widest = f"widest_vec_size<{name}>({hidden}, {tune}::kMaxVecBytes)"
                shapes = ([(widest, "true"), (widest, "false"), ("1", "true"), ("1", "false")]
                          if i == 0 else [(widest, "true")])
                kernels += [f"(void*)&rmsnorm_kernel<Tiling<{hidden}, {name}, {vec}, {tune}>, "
                            f"{tune}, {form}, {plain}>" for vec, plain in shapes for form in FORMS]
    return ["\n".join([*lines, "void* every_kernel[] = {" + ",\n".join(kernels[i::parts]) + "};",
                       ""]) for i in range(parts)]


def test_no_kernel_spills_registers(tmp_path):
    """Every kernel of the default modules and of the tuner's candidates, at the benchmark's
    widths, builds with ptxas refusing spills: under the 8-block register cap a small change of
    the body once had ptxas keep the weight in local memory, 2.7 times slower at 1024x5120 on an
    H100, and fill_sm's plan once left the short path 8-164 bytes short at four widths."""
    from jitk.build import builder as build
    from jitk.build import jit, toolchain

    builds = []
    for i, text in enumerate(_spill_check_sources(max(1, min(4, os.cpu_count() or 1)))):
        source = tmp_path / f"every_rmsnorm_kernel_{i}.cu"
        source.write_text(text)
        command = [toolchain.nvcc_path(), "-ccbin", toolchain.nvcc_host_compiler(),
                   *build.gencode_flags(("9.0",)), *jit.DEFAULT_CUDA_CFLAGS,
                   *build.include_flags([jit.INCLUDE_DIR, jit.KERNEL_DIR]), "-cubin",
                   "-Xptxas=--warn-on-spills", "-Xptxas=--warning-as-error", str(source),
                   "-o", str(source.with_suffix(".cubin"))]
        builds.append(subprocess.Popen(command, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True))
    try:
        for built in builds:
            output = built.communicate(timeout=900)[0]
            spills = [line for line in output.splitlines() if "spill" in line]
            assert built.returncode == 0, "\n".join(spills) or output[-2000:]
    finally:
        for built in builds:
            built.kill()
            built.wait()


@pytest.mark.skipif(HAS_GPU, reason="would launch on a made-up address")
def test_valid_inputs_pass_every_check():
    """Without a driver the launch itself fails: every check before it passed."""
    k, w = kernels(), fake_cuda((128,))
    valid = [
        (fake_cuda((4, 128)), fake_cuda((4, 128))),
        (fake_cuda((2, 3, 128), strides=(3 * 200, 200, 1)), fake_cuda((6, 128))),
        (fake_cuda((1, 1, 128), strides=(7, 3, 1)), fake_cuda((128,))),
        (fake_cuda((4, 128), offset_elements=1), fake_cuda((4, 128), strides=(129, 1))),
    ]
    for x, out in valid:
        assert "CUDA error" in failure(k.rmsnorm, x, w, out, 1e-6)
        assert "CUDA error" in failure(k.fused_add_rmsnorm, x, out, w, 0)
    empty = fake_cuda((0, 128))
    k.rmsnorm(empty, w, empty, 1e-6)  # nothing to launch
    k.fused_add_rmsnorm(empty, empty, w, 1e-6)


def test_precompile_configs_name_cached_loaders(tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))  # no tuning file: the defaults, then
    configs = norm.precompile_configs()  # what a table shipped for this GPU chose, if any
    recorded = [config for space in (norm.RMSNORM_SPACE, norm.FUSED_SPACE)
                for _, config in space.recorded()]
    assert 1 <= len([label for label, _ in configs if " tuned " not in label]) <= 8
    assert bool(recorded) == any(" tuned " in label for label, _ in configs)
    labels = [label for label, _ in configs]
    assert len(set(labels)) == len(labels)
    assert labels[0] == "hidden=128 bfloat16"
    assert configs[0][1]() is kernels()  # the module the tests above built


def test_precompile_builds_what_the_file_records_in_place_too(tmp_path, monkeypatch,
                                                               no_shipped_table):
    from jitk import autotune

    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    bucket = (5120, torch.float16, 16, "in place")
    knobs = {**norm.default_knobs(bucket), "row_registers": 8, "fill_sm": True}
    autotune.record([{"op": "jitk::rmsnorm", "bucket": [5120, "float16", 16, "in place"],
                      "environment": autotune.environment(), "config": knobs}])
    tuned = [loader for label, loader in norm.precompile_configs() if "tuned" in label]
    assert [(loader.func, loader.args) for loader in tuned] == [(norm.chosen_kernels,
                                                                 (bucket, knobs))]


def test_a_call_builds_its_choice_alone_not_the_tuners_candidates(tmp_path, monkeypatch,
                                                                  no_shipped_table):
    """A recorded choice that is one of the tuner's candidates is built as a module of its
    own for calls (one instantiation), not as the candidates' shared module (every
    candidate of the width, several times the build)."""
    from jitk import autotune

    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    bucket = (4096, torch.bfloat16, 16)
    knobs = tuning.candidates(4096, torch.bfloat16, True, False)[1]
    assert knobs != norm.default_knobs(bucket)
    autotune.record([{"op": "jitk::rmsnorm", "bucket": [4096, "bfloat16", 16],
                      "environment": autotune.environment(), "config": knobs}])
    norm.RMSNORM_SPACE.forget()
    assert callable(norm.RMSNORM_SPACE.lookup(bucket))
    built = sorted(entry.path.name.rsplit("_", 2)[0] for entry in cache.list_entries(tmp_path))
    assert len(built) == 1 and built[0].startswith("rmsnorm_tuned_4096_bf16_t"), built


# ---------------------------------------------------------------------------------------
# On a GPU: results against a float64 reference.

def reference(x, weight, eps=1e-6):
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def random(*shape, dtype, scale=1.0):
    """Normal values shifted off zero, so that no row is all zeros and no sign cancels."""
    return (torch.randn(*shape, device="cuda") * scale + 0.25 * scale).to(dtype)


def poisoned_like(x):
    return torch.full_like(x, float("nan"))


def assert_matches(out, expected, dtype):
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=atol)


GPU_CASES = (
    [(torch.bfloat16, h) for h in (1, 7, 64, 100, 128, 1000, 4096, 5120, 8192, 16384, 40000)]
    + [(torch.float16, h) for h in (7, 128, 5120)]
    + [(torch.float32, h) for h in (1, 100, 4096, 16384)]
)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,hidden", GPU_CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_matches_reference(dtype, hidden):
    torch.manual_seed(hidden)
    weight = random(hidden, dtype=dtype)
    for rows in (1, 3, 257):
        x = random(rows, hidden, dtype=dtype, scale=3.0)
        x_before = x.clone()
        out = poisoned_like(x)
        assert norm.rmsnorm(x, weight, out=out) is out
        assert_matches(out, reference(x, weight), dtype)
        assert torch.equal(x, x_before)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,hidden", [(torch.bfloat16, 128), (torch.bfloat16, 5120),
                                          (torch.float16, 128), (torch.float32, 100)])
@pytest.mark.parametrize("offset", [0, 8, 1], ids=["aligned", "aligned-stride", "misaligned"])
def test_strided_rows_in_and_out(dtype, hidden, offset):
    """Rows cut from wider tensors; an offset of one element takes the element-wise path.
    The columns around the output rows must stay untouched."""
    torch.manual_seed(offset)
    rows, pad = 37, 24
    weight = random(hidden, dtype=dtype)
    wide_in = random(rows, hidden + pad, dtype=dtype)
    wide_out = torch.full((rows, hidden + pad + 8), float("nan"), dtype=dtype, device="cuda")
    x = wide_in[:, offset:offset + hidden]
    out = wide_out[:, offset:offset + hidden]
    norm.rmsnorm(x, weight, out=out)
    assert_matches(out, reference(x, weight), dtype)
    outside = torch.ones_like(wide_out, dtype=torch.bool)
    outside[:, offset:offset + hidden] = False
    assert wide_out[outside].isnan().all()


@pytest.mark.gpu
def test_three_dimensional_input_and_output():
    dtype, hidden = torch.bfloat16, 128
    weight = random(hidden, dtype=dtype)
    x = random(2, 5, hidden + 16, dtype=dtype)[:, :, :hidden]  # rows of one stride
    out = poisoned_like(torch.empty(2, 5, hidden, dtype=dtype, device="cuda"))
    norm.rmsnorm(x, weight, out=out)
    assert_matches(out, reference(x, weight), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,hidden", [(torch.bfloat16, 4096), (torch.float32, 100),
                                          (torch.bfloat16, 40000)])
def test_in_place(dtype, hidden):
    weight = random(hidden, dtype=dtype)
    x = random(3, 7, hidden, dtype=dtype)
    expected = reference(x, weight)
    assert norm.rmsnorm(x, weight) is x
    assert_matches(x, expected, dtype)


def cut(rows, hidden, dtype, layout):
    """Fresh random rows of `layout`: contiguous, cut from wider rows ("strided"), or cut
    one element off 16-byte alignment ("misaligned", the element-wise path)."""
    offset, pad = {"contiguous": (0, 0), "strided": (8, 16), "misaligned": (1, 16)}[layout]
    return random(rows, hidden + pad, dtype=dtype, scale=2.0)[:, offset:offset + hidden]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,hidden", [(torch.bfloat16, 128), (torch.bfloat16, 5120),
                                          (torch.float16, 5120), (torch.float32, 4096),
                                          (torch.bfloat16, 40000)])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "misaligned"])
def test_fused_add(dtype, hidden, layout):
    """residual becomes input + residual rounded to the dtype (as torch adds), and input
    the norm of that stored sum."""
    torch.manual_seed(hidden)
    rows = 257
    weight = random(hidden, dtype=dtype)
    x, residual = cut(rows, hidden, dtype, layout), cut(rows, hidden, dtype, layout)
    expected_sum = x + residual
    norm.fused_add_rmsnorm(x, residual, weight)
    assert torch.equal(residual, expected_sum)
    assert_matches(x, reference(expected_sum, weight), dtype)
    # To the bit what rmsnorm of the stored sum gives through the same path.
    mirror = cut(rows, hidden, dtype, layout)
    mirror.copy_(expected_sum)
    assert torch.equal(x, norm.rmsnorm(mirror, weight))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,hidden", [(torch.bfloat16, 128), (torch.bfloat16, 5120),
                                          (torch.float16, 7168), (torch.float32, 4096),
                                          (torch.bfloat16, 40000)])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "misaligned"])
def test_fused_add_float_sum(dtype, hidden, layout):
    """float_sum=True: residual becomes input + residual rounded as before, and input the norm
    of the float32 sum before rounding (FlashInfer's formula), within an ulp of float64 where
    the stored-sum formula is not; with a zero residual, the bits of rmsnorm(input)."""
    torch.manual_seed(hidden + 1)
    rows = 257
    weight = random(hidden, dtype=dtype)
    x, residual = cut(rows, hidden, dtype, layout), cut(rows, hidden, dtype, layout)
    exact_sum, expected_sum = x.double() + residual.double(), x + residual
    stored, stored_residual = x.clone(), residual.clone()
    out = x.clone()
    norm.fused_add_rmsnorm(out, residual, weight, float_sum=True)
    assert torch.equal(residual, expected_sum)
    assert_matches(out, reference(exact_sum, weight), dtype)
    norm.fused_add_rmsnorm(stored, stored_residual, weight)
    if dtype == torch.bfloat16:  # the sum rounds coarsely: some outputs round the other way
        assert not torch.equal(out, stored)
    # The same rows in the same layout (a misaligned row takes another kernel's order).
    source, alone = cut(rows, hidden, dtype, layout), cut(rows, hidden, dtype, layout)
    source.copy_(x)
    alone.copy_(x)
    norm.fused_add_rmsnorm(alone, torch.zeros_like(alone), weight, float_sum=True)
    assert torch.equal(alone, norm.rmsnorm(source, weight))


@pytest.mark.gpu
@pytest.mark.parametrize("changes", [*tuning.TRIED, *tuning.TRIED_SHORT, *tuning.TRIED_LONG,
                                     *tuning.TRIED_AT_SHORT_LIMIT], ids=str)
@pytest.mark.parametrize("hidden", [5120, 12288])
@pytest.mark.parametrize("layout", ["contiguous", "misaligned", "heads"])
def test_tried_knobs_match_reference(changes, hidden, layout):
    """Every choice the tuner tries, both entry points, on 77 rows of 5 to 32 warps (12288 at 4
    registers: 1024 threads, some with a slot past the row's end); misaligned rows and rows
    in two runs (heads of a wider buffer) take the defaults' kernels in the same module."""
    dtype, rows = torch.bfloat16, 77
    bucket = (hidden, dtype, 128)
    kernels = norm.kernels_with(bucket, {**norm.default_knobs(bucket), **changes})
    weight = random(hidden, dtype=dtype)

    def fresh():
        if layout == "heads":  # rows in two runs: 7 tokens of 11 heads, strides (36 h, 3 h)
            return random(7, 12, 3, hidden, dtype=dtype, scale=3.0)[:, :11, 0]
        return cut(rows, hidden, dtype, layout)

    x = fresh()
    out = poisoned_like(x)
    kernels.rmsnorm(x, weight, out, 1e-6)
    assert_matches(out, reference(x, weight), dtype)
    residual = fresh()
    expected_sum = x + residual
    kernels.fused_add_rmsnorm(x, residual, weight, 1e-6)
    assert torch.equal(residual, expected_sum)
    assert_matches(x, reference(expected_sum, weight), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,hidden", [(torch.bfloat16, 512), (torch.float16, 7168),
                                          (torch.float32, 2560), (torch.bfloat16, 16384)],
                         ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("late_trigger", [False, True])
def test_two_vectors_match_reference(dtype, hidden, late_trigger):
    """two_vectors' own kernel in each dtype, from one warp a row (1024 bytes) to 1024
    threads (32 KiB), both entry points, in and out of place, on fresh rows each run."""
    bucket = (hidden, dtype, 1024)
    kernels = norm.kernels_with(bucket, {**norm.default_knobs(bucket), "two_vectors": True,
                                          "late_trigger": late_trigger})
    weight = random(hidden, dtype=dtype)
    for rows in (1, 5, 300):
        x = random(rows, hidden, dtype=dtype, scale=3.0)
        out = poisoned_like(x)
        kernels.rmsnorm(x, weight, out, 1e-6)
        assert_matches(out, reference(x, weight), dtype)
        expected = reference(x, weight)
        kernels.rmsnorm(x, weight, x, 1e-6)
        assert_matches(x, expected, dtype)
        x, residual = (random(rows, hidden, dtype=dtype, scale=3.0) for _ in range(2))
        expected_sum = x + residual
        kernels.fused_add_rmsnorm(x, residual, weight, 1e-6)
        assert torch.equal(residual, expected_sum)
        assert_matches(x, reference(expected_sum, weight), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [3, 256])
def test_a_choice_without_pdl_gives_the_same_bits(rows):
    """PDL off (tried beside a GEMM) launches the same kernel: equal results, both ops."""
    dtype, hidden = torch.float16, 5120
    bucket = (hidden, dtype, rows)
    x, residual = (random(rows, hidden, dtype=dtype) for _ in range(2))
    weight = random(hidden, dtype=dtype)
    results = []
    for pdl in (True, False):
        kernels = norm.kernels_with(bucket, {**norm.default_knobs(bucket), "pdl": pdl})
        out, x_, residual_ = poisoned_like(x), x.clone(), residual.clone()
        kernels.rmsnorm(x, weight, out, 1e-6)
        kernels.fused_add_rmsnorm(x_, residual_, weight, 1e-6)
        results.append((out, x_, residual_))
    assert_matches(results[1][0], reference(x, weight), dtype)
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.gpu
def test_eps_is_honoured():
    dtype, hidden = torch.float32, 100
    weight = random(hidden, dtype=dtype)
    x = random(5, hidden, dtype=dtype, scale=0.1)  # mean square about 0.01
    for eps in (0.0, 1e-6, 1.0):
        out = norm.rmsnorm(x, weight, out=poisoned_like(x), eps=eps)
        assert_matches(out, reference(x, weight, eps), dtype)
    assert not torch.allclose(out.double(), reference(x, weight, 1e-6), rtol=0.1)


@pytest.mark.gpu
def test_empty_and_single_element_rows():
    weight = random(128, dtype=torch.bfloat16)
    empty = torch.empty(0, 128, dtype=torch.bfloat16, device="cuda")
    assert norm.rmsnorm(empty, weight, out=empty) is empty
    norm.fused_add_rmsnorm(empty, empty.clone(), weight)
    x = random(9, 1, dtype=torch.float32)
    one = random(1, dtype=torch.float32)
    out = norm.rmsnorm(x, one, out=poisoned_like(x))
    assert_matches(out, reference(x, one), torch.float32)  # sign(x) * weight, nearly


@pytest.mark.gpu
def test_runs_on_the_callers_current_stream():
    dtype, hidden = torch.bfloat16, 4096
    weight = random(hidden, dtype=dtype)
    source = random(4096, hidden, dtype=dtype)
    x, out = poisoned_like(source), poisoned_like(source)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # on another stream the kernel would read NaNs
        x.copy_(source)
        norm.rmsnorm(x, weight, out=out)
    side.synchronize()
    assert_matches(out, reference(source, weight), dtype)


@pytest.mark.gpu
def test_captured_in_a_cuda_graph():
    dtype, hidden = torch.bfloat16, 4096
    weight = random(hidden, dtype=dtype)
    x, residual = random(16, hidden, dtype=dtype), random(16, hidden, dtype=dtype)
    out = poisoned_like(x)
    norm.rmsnorm(x, weight, out=out)  # load outside the capture
    norm.fused_add_rmsnorm(out, residual, weight)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        norm.rmsnorm(x, weight, out=out)
        norm.fused_add_rmsnorm(out, residual, weight)
    for _ in range(3):
        x.copy_(random(16, hidden, dtype=dtype))
        residual_before = random(16, hidden, dtype=dtype)
        residual.copy_(residual_before)
        out.fill_(float("nan"))
        graph.replay()
        normed = norm.rmsnorm(x, weight, out=poisoned_like(x))
        assert torch.equal(residual, normed + residual_before)
        assert_matches(out, reference(residual, weight), dtype)


QKV_CASES = [  # (dtype, head_dim, q heads, kv heads)
    (torch.bfloat16, 128, 32, 8), (torch.bfloat16, 64, 16, 2), (torch.float16, 128, 8, 1),
    (torch.float32, 128, 4, 4), (torch.bfloat16, 256, 8, 1), (torch.bfloat16, 96, 6, 2),
]


def qkv_buffer(tokens, head_dim, q_heads, kv_heads, dtype):
    """A fused QKV projection output and [tokens, heads, head_dim] views of its q and k."""
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    qkv = random(tokens, q_size + 2 * kv_size, dtype=dtype, scale=2.0)
    q = qkv[:, :q_size].view(tokens, q_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(tokens, kv_heads, head_dim)
    return qkv, q, k


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,q_heads,kv_heads", QKV_CASES,
                         ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_qk_norm_on_heads_of_a_fused_qkv_buffer(dtype, head_dim, q_heads, kv_heads, tokens):
    """Strided heads give exactly what the same values give as contiguous rows, match the
    reference, and leave every other element of the buffer as it was."""
    torch.manual_seed(tokens * head_dim + q_heads)
    qkv, q, k = qkv_buffer(tokens, head_dim, q_heads, kv_heads, dtype)
    q_weight, k_weight = random(head_dim, dtype=dtype), random(head_dim, dtype=dtype)
    before = qkv.clone()
    # Copies (.contiguous() would return the view itself for one token).
    q_values = q.clone(memory_format=torch.contiguous_format)
    k_values = k.clone(memory_format=torch.contiguous_format)

    out = poisoned_like(q_values)
    norm.rmsnorm(q, q_weight, out=out)
    assert_matches(out, reference(q_values, q_weight), dtype)
    assert torch.equal(out, norm.rmsnorm(q_values.clone(), q_weight))
    assert torch.equal(qkv, before)

    # In place on both views, as a model's q/k-norm runs.
    assert norm.rmsnorm(q, q_weight) is q
    norm.rmsnorm(k, k_weight)
    assert torch.equal(q, out)
    assert_matches(k, reference(k_values, k_weight), dtype)
    untouched = torch.ones_like(qkv, dtype=torch.bool)
    untouched[:, :q.shape[1] * head_dim + k.shape[1] * head_dim] = False
    assert torch.equal(qkv[untouched], before[untouched])

    # Into the heads of another, poisoned buffer: strides on both sides.
    target, q_out, _ = qkv_buffer(tokens, head_dim, q_heads, kv_heads, dtype)
    target.fill_(float("nan"))
    norm.rmsnorm(q_values, q_weight, out=q_out)
    assert torch.equal(q_out, out)
    assert target[:, q.shape[1] * head_dim:].isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,q_heads,kv_heads", QKV_CASES[:4],
                         ids=lambda v: str(v).removeprefix("torch."))
def test_fused_add_on_strided_heads(dtype, head_dim, q_heads, kv_heads):
    torch.manual_seed(head_dim)
    tokens = 129
    _, x, _ = qkv_buffer(tokens, head_dim, q_heads, kv_heads, dtype)
    _, residual, _ = qkv_buffer(tokens, head_dim, q_heads, kv_heads, dtype)
    weight = random(head_dim, dtype=dtype)
    expected_sum = x + residual
    norm.fused_add_rmsnorm(x, residual, weight)
    assert torch.equal(residual, expected_sum)
    assert_matches(x, reference(expected_sum, weight), dtype)
    assert torch.equal(x, norm.rmsnorm(expected_sum.contiguous(), weight))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interleaved_and_misaligned_heads(dtype):
    """Heads-major memory read as [tokens, heads, dim] (rows of one run interleave with the
    next), and heads one element off 16-byte alignment (the element-wise path)."""
    torch.manual_seed(3)
    tokens, heads, dim = 33, 6, 128
    weight = random(dim, dtype=dtype)
    heads_major = random(heads, tokens, dim, dtype=dtype)
    x = heads_major.transpose(0, 1)
    expected = reference(x, weight)
    norm.rmsnorm(x, weight)
    assert_matches(x, expected, dtype)

    wide = random(tokens, heads * dim + 9, dtype=dtype)
    misaligned = wide.as_strided((tokens, heads, dim), (heads * dim + 9, dim, 1), 1)
    out = poisoned_like(torch.empty(tokens, heads, dim, dtype=dtype, device="cuda"))
    norm.rmsnorm(misaligned, weight, out=out)
    assert_matches(out, reference(misaligned, weight), dtype)
    residual = random(tokens, heads, dim, dtype=dtype)
    expected_sum = misaligned + residual
    norm.fused_add_rmsnorm(misaligned, residual, weight)
    assert torch.equal(residual, expected_sum)
    assert_matches(misaligned, reference(expected_sum, weight), dtype)


def test_defaults_leave_every_decode_size_knob_off():
    """The defaults are main's kernel: the short-path, late-trigger and fill-SM knobs off."""
    for bucket in ((4096, torch.bfloat16, 1), (128, torch.float16, 4096)):
        knobs = norm.default_knobs(bucket)
        assert (knobs["broadcast_sum"], knobs["pin_offsets"], knobs["row_first"],
                knobs["sum_chains"], knobs["late_trigger"], knobs["fill_sm"]) == (
                    False, False, False, 1, False, False)


@pytest.fixture
def unstable(monkeypatch):
    """JITK_RMSNORM_FAST_UNSTABLE=1: the tried changes as written, whatever their order of
    summation. The spaces work a bucket's candidates out once, so they forget them here."""
    for space in (norm.RMSNORM_SPACE, norm.FUSED_SPACE):
        monkeypatch.setattr(space, "_candidates", {})
    monkeypatch.setenv("JITK_RMSNORM_FAST_UNSTABLE", "1")


@pytest.mark.parametrize("space", [norm.RMSNORM_SPACE, norm.FUSED_SPACE],
                         ids=["rmsnorm", "fused_add_rmsnorm"])
def test_by_default_the_tuner_times_each_change_in_the_defaults_order(space):
    """Batch invariance: a change that would add a row in another order is timed with
    row_registers, max_vec_bytes, sum_chains and two_vectors at the default's values, its
    launch changes kept but fill_sm; the flag times it as written (below)."""
    for bucket in ((4096, torch.bfloat16, 256), (4096, torch.bfloat16, 1024),
                   (5120, torch.float16, 16), (128, torch.float32, 4096)):
        hidden, dtype, _ = bucket
        default = norm.default_knobs(bucket)
        candidates = space.candidates(bucket, beside=True)
        assert all(norm.rules.keeps_order(c, hidden, dtype) for c in candidates)
        assert not any(c["two_vectors"] or c["sum_chains"] != 1 for c in candidates)
        # TRIED's {row_registers 8, late_trigger, fill_sm, one_turn}: as written where 8
        # registers spread the default's threads in its order (4096 bf16: 256 threads, not
        # 128; 5120 fp16: 320), else with the default's registers and without fill_sm (128
        # fp32: a row of 8 lanes, which 8 registers would make 16).
        sglang_like = {**default, **tuning._SGLANG_LIKE, **tuning._FILL_SM, **tuning._ONE_TURN}
        spread = norm.rules.spread(hidden, dtype, sglang_like)
        assert spread == (1 if hidden == 128 else 2)
        put_back = {**default, "late_trigger": True, "one_turn": True}
        assert (sglang_like if spread > 1 else put_back) in candidates
    short = space.candidates((4096, torch.bfloat16, 256))
    assert (len(short), len(space.candidates((4096, torch.bfloat16, 512)))) == (11, 9)


@pytest.mark.parametrize("space", [norm.RMSNORM_SPACE, norm.FUSED_SPACE],
                         ids=["rmsnorm", "fused_add_rmsnorm"])
def test_tuner_tries_the_short_launch_choices_only_up_to_256_rows(space, unstable):
    short, long = ((4096, torch.bfloat16, rows) for rows in (256, 512))
    default = norm.default_knobs(short)
    short_candidates, long_candidates = space.candidates(short), space.candidates(long)
    assert short_candidates[0] == long_candidates[0] == default
    at_limit = len(tuning.TRIED_AT_SHORT_LIMIT)
    assert len(short_candidates) == 1 + len(tuning.TRIED) + len(tuning.TRIED_SHORT) + at_limit
    assert len(long_candidates) == 1 + len(tuning.TRIED) + len(tuning.TRIED_LONG)
    assert (len(short_candidates), len(long_candidates)) == (13, 11)
    # Block 0's weight prefetch is left out only at 256 rows, where cold weights did not miss
    # it; below, they did.
    below = space.candidates((4096, torch.bfloat16, 128))
    assert len(below) == 12 and all(c["prefetch_weight"] for c in (*below, *long_candidates))
    assert [c for c in short_candidates if not c["prefetch_weight"]] == [
        {**default, **changes} for changes in tuning.TRIED_AT_SHORT_LIMIT]
    shared = [{**default, **changes} for changes in tuning.TRIED]
    assert all(c in short_candidates and c in long_candidates for c in shared)
    # Several partial sums, without the loop, only: in short launches with fewer threads too;
    # in long ones with the loop, and with registers capped to fill an SM.
    assert not any(c["row_registers"] == 8 and c["sum_chains"] == 4 for c in long_candidates)
    assert not any(c["fill_sm"] and c["row_registers"] == 16 for c in short_candidates)
    assert {**default, **tuning._SHORT_PATH, "fill_sm": True} in long_candidates
    # Beside a GEMM, each choice also without PDL; after itself, PDL always.
    for bucket, alone in ((short, short_candidates), (long, long_candidates)):
        beside = space.candidates(bucket, beside=True)
        assert all(c["pdl"] for c in alone) and beside[:1] == alone[:1]
        assert sorted(map(str, beside)) == sorted(
            str({**c, "pdl": pdl}) for c in alone for pdl in (True, False))


def test_two_vectors_is_tried_past_256_rows_where_it_fits(unstable):
    """Where rmsnorm_kernels.cuh's TwoVectors fits: a row of a multiple of 1024 bytes, up to 32 KiB;
    only with JITK_RMSNORM_FAST_UNSTABLE=1, since it adds a row in an order of its own."""
    for hidden, dtype, fits in ((512, torch.bfloat16, True), (7168, torch.float16, True),
                                (8192, torch.float32, True), (16384, torch.bfloat16, True),
                                (128, torch.bfloat16, False), (3000, torch.float16, False),
                                (16384, torch.float32, False), (32768, torch.bfloat16, False)):
        two_vectors = {**norm.default_knobs((hidden, dtype)), "two_vectors": True}
        assert two_vectors not in tuning.candidates(hidden, dtype)
        assert (two_vectors in tuning.candidates(hidden, dtype, True, True)) == fits, hidden
        for rows, tried in ((256, False), (1024, fits), (4096, fits)):
            assert tuning.tried((hidden, dtype, rows), two_vectors) == tried, (hidden, rows)


def test_tune_builds_two_modules_per_width_and_dtype():
    """The default's, and one that holds every other choice the tuner tries: both ops and
    every row bucket of a width share them."""
    modules = {("jitk.kernels.norm", 5120, torch.bfloat16, "default"),
               ("jitk.kernels.norm", 5120, torch.bfloat16, "candidates", False)}
    # Beside a GEMM, each of the 15 choices without PDL too, in a module of their own.
    for beside, choices, more in ((False, 15, set()), (True, 30, {
            ("jitk.kernels.norm", 5120, torch.bfloat16, "candidates without PDL", False)})):
        keys, configs = set(), set()
        for space in (norm.RMSNORM_SPACE, norm.FUSED_SPACE):
            for rows in (1, 16, 128, 256, 1024, 4096):
                bucket = (5120, torch.bfloat16, rows)
                for config in space.candidates(bucket, beside):
                    keys.add(space.job_key(bucket, config))
                    configs.add(tuple(config.values()))
        assert len(configs) == choices and keys == modules | more


def test_the_candidates_module_builds_every_choice_and_checks_its_arguments():
    """The module of the tuner's choices with PDL at a width (for sm_90 here): an entry pair
    per choice, each with the kernel's own checks; those without PDL, another."""
    kernels_ = norm.candidate_kernels(128, torch.bfloat16)
    assert len(kernels_) == len(tuning.candidates(128, torch.bfloat16)) == 9
    assert len(tuning.candidates(128, torch.bfloat16, pdl=False)) == 10  # the default's too
    x, w = torch.randn(4, 128, dtype=torch.bfloat16), torch.randn(128, dtype=torch.bfloat16)
    for pair in kernels_:
        assert "device" in failure(pair.rmsnorm, x, w, torch.empty_like(x), 1e-6)
        assert "device" in failure(pair.fused_add_rmsnorm, x, x.clone(), w, 1e-6)


def test_a_choice_outside_the_candidates_gets_a_module_of_its_own():
    bucket = (5120, torch.bfloat16, 16)
    knobs = {**norm.default_knobs(bucket), "row_registers": 8, "register_cap": False}
    assert knobs not in tuning.candidates(5120, torch.bfloat16)
    assert norm.module_key(bucket, knobs) == ("jitk.kernels.norm", 5120, torch.bfloat16,
                                               *tuning.knob_values(knobs))


@pytest.mark.parametrize("name", ["jitk::rmsnorm", "jitk::fused_add_rmsnorm"])
def test_tuning_samples_pass_every_argument(name):
    """A built kernel takes no defaults: the tuner's sample call names every parameter but the
    keyword-only ones, which pick another kernel (float_sum) rather than reach this one."""
    info = jitk.runtime.op.find_op(name)
    kernel_params = [name for name, p in info.signature.parameters.items()
                     if p.kind is not p.KEYWORD_ONLY]
    for args, kwargs in info.tuning.sample_calls((3, 256), torch.float16, torch.device("cpu")):
        bound = info.signature.bind(*args, **kwargs)
        assert list(bound.arguments) == kernel_params


def test_rmsnorm_in_place_is_a_bucket_of_its_own():
    """rmsnorm is tuned and looked up apart in place; the fused form is in place always."""
    info = jitk.runtime.op.find_op("jitk::rmsnorm")
    calls = info.tuning.sample_calls((3, 256), torch.float16, torch.device("cpu"))
    buckets = [info.tuning.bucket(*args, **kwargs) for args, kwargs in calls]
    assert buckets == [(256, torch.float16, 4), (256, torch.float16, 4, "in place")]
    x, weight, out, eps = calls[0][0]
    assert info.tuning.bucket(x, weight, out=x, eps=eps) == buckets[1]
    fused = jitk.runtime.op.find_op("jitk::fused_add_rmsnorm").tuning
    (args, kwargs), = fused.sample_calls((3, 256), torch.float16, torch.device("cpu"))
    assert fused.bucket(*args, **kwargs) == (256, torch.float16, 4)
