"""load_jit(..., cuda_compiler="nvrtc"): a kernel file in two halves (jitk/nvrtc.cuh), its
host half built by the host compiler alone and its kernels by NVRTC in the process.

CPU part: the entry holds the library, a cubin per target and the kernel names the host half
registered; its argument checks run and name the tensor and line; a damaged cubin makes the
entry unusable rather than loaded; the same file still builds under nvcc; bad arguments are
refused before any build. GPU part: both halves' results against a float64 reference and
against the nvcc build of the same file, bit for bit."""

import ctypes
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from child_env import PYTHON_PATH
from errors import expect_error
from needs_nvrtc import NEEDS_NVRTC

import jitk
from jitk.build import cache, nvrtc, pch, toolchain
from jitk.build.build_errors import JitCompileError
from jitk.build.builder import host_half_flags

# The developer guide's kernel, written in two halves.
KERNEL = Path(__file__).resolve().parents[1] / "docs" / "developer_guide" / "example" / "axpy.cuh"
WRAPPERS = [("axpy_f32", "axpy::Axpy<fp32_t>::run"), ("axpy_bf16", "axpy::Axpy<bf16_t>::run")]
EXPRESSIONS = ["&axpy::axpy_kernel<float>", "&axpy::axpy_kernel<__nv_bfloat16>"]


pytestmark = NEEDS_NVRTC


def load(compiler: str = "nvrtc", **changes):
    return jitk.load_jit("nvrtc_axpy", "fp32_t", "bf16_t", cuda_files=[KERNEL],
                         cuda_wrappers=WRAPPERS, cuda_compiler=compiler, **changes)


def entry_of(cache: Path) -> Path:
    (entry,) = [p for p in cache.iterdir() if p.is_dir() and p.name.startswith("nvrtc_axpy_")]
    return entry


def test_the_entry_holds_the_host_half_and_each_targets_device_code(tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("JITK_CUDA_ARCH", "8.0;9.0")
    jitk.jit_stats(reset=True)
    load()
    [event] = jitk.jit_stats()["events"]  # the build's phases: the host half, then NVRTC's
    assert event["source"] == "build"
    assert list(event["phases"]) == ["compilers", "nvrtc", "publish"]
    assert all(seconds > 0 for seconds in event["phases"].values())
    entry = entry_of(tmp_path)
    stem = "nvrtc_axpy_fp32_t_bf16_t"
    files = {p.name for p in entry.iterdir()}
    assert {f"{stem}.so", f"{stem}.kernels"} <= files
    assert "cuda.cu" not in files  # no nvcc unit: the host half is host_half.cpp
    lines = [line.split("\t") for line in (entry / f"{stem}.kernels").read_text().splitlines()]
    assert sorted(expression for expression, _, _ in lines) == sorted(EXPRESSIONS)
    assert all(lowered.startswith("_ZN4axpy11axpy_kernelI") for _, lowered, _ in lines)
    # Each kernel's part holds a cubin for each target, and nothing else is device code.
    cubins = {f"{stem}.{part}.{sm}.cubin" for _, _, part in lines for sm in ("sm_80", "sm_90")}
    assert cubins == {name for name in files if name.endswith(".cubin")}
    for cubin in cubins:
        assert (entry / cubin).read_bytes()[:4] == b"\x7fELF"
    # A fat build keeps its newest target's PTX too, for GPUs newer than every target.
    ptx = {f"{stem}.{part}.compute_90.ptx" for _, _, part in lines}
    assert ptx == {name for name in files if name.endswith(".ptx")}
    for text in ptx:
        assert b".target sm_90" in (entry / text).read_bytes()
    meta = json.loads((entry / "jitk-meta.json").read_text())
    assert set(meta["device_code"]) == cubins | ptx | {f"{stem}.kernels"}
    assert any(name.endswith("include/jitk/nvrtc.cuh") for name in meta["headers"])


def test_the_host_half_checks_its_arguments_and_names_them():
    module = load()
    x, y = torch.ones(8), torch.ones(8)
    expect_error(lambda: module.axpy_f32(1.0, x, y), "'x'", "axpy.cuh:",
                 "expected cuda but got cpu")
    expect_error(lambda: module.axpy_bf16(1.0, x, y), "'x'", "dtype")


LOAD_CACHED = """
import sys, jitk
sys.path.insert(0, sys.argv[1])
from test_nvrtc_build import load
load()
print(jitk.jit_stats()["disk"]["count"])
"""


def _load_in_child(cache: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOAD_CACHED, str(Path(__file__).parent)],
                          env={**os.environ, "JITK_CACHE_DIR": str(cache),
                               "PYTHONPATH": PYTHON_PATH, **env},
                          capture_output=True, text=True, timeout=300, check=False)


def test_a_new_process_loads_the_entry_and_a_damaged_cubin_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    load()
    loaded = _load_in_child(tmp_path, JITK_DISABLE_JIT="1")
    assert loaded.returncode == 0 and loaded.stdout.split()[-1] == "1", loaded.stderr[-2000:]
    cubin = sorted(entry_of(tmp_path).glob("*.cubin"))[-1]
    image = bytearray(cubin.read_bytes())
    image[len(image) // 2] ^= 0xFF
    cubin.write_bytes(bytes(image))
    refused = _load_in_child(tmp_path, JITK_DISABLE_JIT="1")
    assert refused.returncode != 0
    assert f"{cubin.name} is damaged" in refused.stderr, refused.stderr[-2000:]


def test_the_same_file_builds_under_nvcc_into_another_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    module = load("nvcc")
    expect_error(lambda: module.axpy_f32(1.0, torch.ones(8), torch.ones(8)), "'x'")
    load("nvrtc")
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("nvrtc_axpy_")
                and p.is_dir()]) == 2


@pytest.mark.parametrize("setting, unit", [("nvcc", "cuda.cu"), ("nvrtc", "host_half.cpp")])
def test_auto_builds_as_the_setting_says(tmp_path, monkeypatch, setting, unit):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("JITK_CUDA_COMPILER", setting)
    load("auto")
    assert (entry_of(tmp_path) / unit).is_file()


def test_auto_needs_the_toolkits_libcu_headers(tmp_path):
    """A toolkit without CCCL's headers (a runtime-only wheel, say) gets nvcc, not an NVRTC
    build that cannot find <cuda/std/...>; one with them, NVRTC."""
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cuda_runtime.h").write_text("")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    ask = "from jitk.build import nvrtc; print(nvrtc.choose('auto'), nvrtc.choose('nvrtc'))"
    env = {k: v for k, v in os.environ.items() if k not in ("JITK_CUDA_COMPILER", "JITK_NVCC")}
    for home, expected in ((tmp_path, "nvcc nvrtc"), (toolchain.cuda_home(), "nvrtc nvrtc")):
        done = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True,
                              env={**env, "CUDA_HOME": str(home),
                                   "PYTHONPATH": PYTHON_PATH}, timeout=120, check=False)
        assert done.stdout.split() == expected.split(), done.stderr[-2000:]


def test_auto_finds_nvrtcs_entry_without_asking_the_toolkit(tmp_path, monkeypatch):
    """A warm load of "auto" neither loads libnvrtc nor looks for the toolkit: a new process
    whose CUDA_HOME is no toolkit at all still loads the NVRTC entry from the cache."""
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("JITK_CUDA_COMPILER", raising=False)
    load("auto")
    entry = entry_of(tmp_path)
    ask = ("import sys; sys.path.insert(0, sys.argv[1]); import test_nvrtc_build as t, jitk\n"
           "def nvrtc_mapped(): return 'libnvrtc.so' in open('/proc/self/maps').read()\n"
           "before = nvrtc_mapped(); t.load('auto')\n"
           "s = jitk.jit_stats(); print(s['disk']['count'], s['build']['count'],"
           " nvrtc_mapped() and not before)")
    env = {k: v for k, v in os.environ.items() if k not in ("JITK_CUDA_COMPILER", "JITK_NVCC")}
    done = subprocess.run([sys.executable, "-c", ask, str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**env, "CUDA_HOME": str(tmp_path / "no-toolkit"),
                               "PYTHONPATH": PYTHON_PATH})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1", "0", "False"], done.stdout
    assert [p for p in tmp_path.iterdir() if p.is_dir() and p.name[0] != "."] == [entry]


def test_auto_builds_with_nvcc_where_nvrtc_cannot_build(tmp_path, monkeypatch):
    """A miss asks whether NVRTC can build here; where it cannot, "auto" finds or builds
    nvcc's entry, and an NVRTC entry already cached is still used."""
    monkeypatch.delenv("JITK_CUDA_COMPILER", raising=False)
    empty, cached = tmp_path / "empty", tmp_path / "cached"
    monkeypatch.setenv("JITK_CACHE_DIR", str(cached))
    load("nvrtc")
    monkeypatch.setattr(nvrtc, "builds_here", lambda: False)
    for folder, unit in ((empty, "cuda.cu"), (cached, "host_half.cpp")):
        monkeypatch.setenv("JITK_CACHE_DIR", str(folder))
        load("auto")
        assert (entry_of(folder) / unit).is_file()


def test_nvrtcs_version_is_its_builtins_and_the_library_must_agree(tmp_path, monkeypatch):
    """The key's NVRTC version is read beside the library, without loading it; a library
    whose builtins are of another version is refused at a build, not used."""
    real = nvrtc.version()
    (tmp_path / "libnvrtc.so.13").write_bytes(b"")
    (tmp_path / "libnvrtc-builtins.so.12.9").write_bytes(b"")
    monkeypatch.setattr(nvrtc, "library_path", lambda: str(tmp_path / "libnvrtc.so.13"))
    nvrtc.version.cache_clear()
    try:
        assert nvrtc.version() == (12, 9)
        if real != (12, 9):
            expect_error(lambda: nvrtc.compile_cubin("__global__ void k() {}", "k.cu", [],
                                                     ["-arch=sm_90"]),
                         "is version", "builtins beside it are (12, 9)", "reinstall",
                         kind=nvrtc.NvrtcError)
    finally:
        nvrtc.version.cache_clear()


def test_bad_arguments_are_refused_before_any_build(tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    expect_error(lambda: load("clang"), "cuda_compiler", "'nvcc', 'nvrtc' or 'auto'", "'clang'",
                 kind=ValueError)
    expect_error(lambda: load(extra_cuda_cflags=["-lineinfo"]), "extra_cuda_cflags are nvcc's",
                 kind=ValueError)
    assert not any(tmp_path.iterdir())


def test_two_modules_in_one_process_keep_their_own_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    other = tmp_path / "other_axpy.cuh"
    other.write_text(KERNEL.read_text().replace("namespace axpy", "namespace other_axpy"))
    jitk.load_jit("other_axpy", "fp32_t", cuda_files=[other], cuda_compiler="nvrtc",
                  cuda_wrappers=[("axpy_f32", "other_axpy::Axpy<fp32_t>::run")])
    load()  # after the other module's library is loaded in this process
    lines = (entry_of(tmp_path) / "nvrtc_axpy_fp32_t_bf16_t.kernels").read_text().splitlines()
    assert sorted(line.split("\t")[0] for line in lines) == sorted(EXPRESSIONS)


def test_a_library_takes_all_its_device_code(tmp_path, monkeypatch):
    """A fat build of many parts hands its library a cubin per part and target, the PTX and the
    names: 41 files for RMSNorm's 8 kernels on a 16-core host for 4 targets, past the fixed 32
    a first version kept (its fleet build failed on the GPU host so)."""
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    load()
    library = ctypes.CDLL(str(next(entry_of(tmp_path).glob("*.so"))))
    adopt = library.jitk_nvrtc_adopt
    adopt.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    for index in range(64):
        assert adopt(f"extra.{index}.sm_90.cubin".encode(), b"x", 1) == 0, index


def test_an_error_in_the_device_half_is_nvrtcs_message(tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    broken = tmp_path / "broken.cuh"
    broken.write_text(KERNEL.read_text().replace("if (i < n) y[i]", "if (i < n) z[i]"))
    with pytest.raises(JitCompileError, match=r'identifier "z" is undefined'):
        jitk.load_jit("nvrtc_broken", "fp32_t", cuda_files=[broken],
                      cuda_wrappers=WRAPPERS[:1], cuda_compiler="nvrtc")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_builds_compute_axpy_alike(dtype):
    n = 100_003
    x, y = torch.randn(n, device="cuda").to(dtype), torch.randn(n, device="cuda").to(dtype)
    expected = (0.5 * x.double() + y.double()).to(dtype)
    results = []
    for compiler in ("nvrtc", "nvcc"):
        out = y.clone()
        getattr(load(compiler), "axpy_f32" if dtype == torch.float32 else "axpy_bf16")(
            0.5, x, out)
        torch.cuda.synchronize()
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-2 if dtype != torch.float32
                                   else 1e-5)
        results.append(out)
    assert torch.equal(results[0], results[1])


def _wait_for_preludes(timeout: float = 120.0) -> None:
    for thread in [t for t in threading.enumerate() if t.name == "jitk-prelude"]:
        thread.join(timeout)
        assert not thread.is_alive(), "the prelude's build did not end"


def test_builds_after_the_first_read_the_precompiled_prelude(tmp_path, monkeypatch):
    """The first build starts the prelude and goes without it; the next build reads it, and
    its record still names the headers inside it (an edit of one rebuilds the entry)."""
    monkeypatch.setenv("JITK_HOST_PRELUDE", "1")
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    other = tmp_path / "src" / "other_axpy.cuh"
    other.parent.mkdir()
    other.write_text(KERNEL.read_text().replace("namespace axpy", "namespace other_axpy"))
    load()
    assert "-include" not in (entry_of(tmp_path) / "build.ninja").read_text()
    _wait_for_preludes()
    (prelude,) = (tmp_path / pch.FOLDER).glob("*/prelude.h.gch")
    module = jitk.load_jit("other_axpy", "fp32_t", cuda_files=[other], cuda_compiler="nvrtc",
                           cuda_wrappers=[("axpy_f32", "other_axpy::Axpy<fp32_t>::run")])
    x, y = torch.ones(3), torch.zeros(3)
    expect_error(lambda: module.axpy_f32(1.0, x, y), "'x'", "cuda")  # its checks still run
    (entry,) = [p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith("other_axpy_")]
    ninja = (entry / "build.ninja").read_text()
    assert f"-include {prelude.parent / 'prelude.h'}" in ninja
    assert str(prelude.parent / pch.RUNTIME) in ninja  # the runtime, linked, not compiled again
    defined = subprocess.run(["nm", "--defined-only", "-C", str(entry / "host_half.o")],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    assert "TensorMatcher::verify" not in defined and "jitk_nvrtc_kernel_names" not in defined
    own = (entry / "host_half.o.d").read_text()
    assert "jitk/tensor.h" not in own  # read from the prelude, not parsed again
    meta = json.loads((entry / "jitk-meta.json").read_text())
    assert any(name.endswith("include/jitk/tensor.h") for name in meta["headers"])
    assert not any(pch.FOLDER in name for name in meta["headers"])
    assert {e.path.name for e in cache.list_entries(tmp_path)} == {entry.name,
                                                                   entry_of(tmp_path).name}


def test_a_prelude_that_cannot_be_built_costs_only_time(tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_HOST_PRELUDE", "1")
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    (tmp_path / pch.FOLDER).write_text("not a folder")  # nothing can be made under it
    assert pch.build(toolchain.host_compiler(), ["-std=c++20"]) is None
    load()
    _wait_for_preludes()
    assert (tmp_path / pch.FOLDER).read_text() == "not a folder"
    assert "-include" not in (entry_of(tmp_path) / "build.ninja").read_text()


def test_a_prelude_others_could_have_written_is_not_read(tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_HOST_PRELUDE", "1")
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    flags = host_half_flags(("9.0",), [str(pch.INCLUDE)])  # a host half's, as builds use
    built = pch.build(toolchain.host_compiler(), flags)
    assert built is not None and pch.prelude(toolchain.host_compiler(), flags) == built
    for name in ("prelude.h.gch", pch.RUNTIME):  # code the compiler and the linker take
        (built.folder / name).chmod(0o666)  # anyone could have replaced it
        assert pch.prelude(toolchain.host_compiler(), flags) is None
        (built.folder / name).chmod(0o644)
        assert pch.prelude(toolchain.host_compiler(), flags) == built
    monkeypatch.setenv("JITK_HOST_PRELUDE", "0")
    assert pch.prelude(toolchain.host_compiler(), flags) is None
