"""Modules built for several GPU architectures at once ("fat"): every shipped kernel builds
for sm_80, sm_90, sm_100 and sm_120, and an entry built for more architectures serves a
process that asks for one of them, under JITK_DISABLE_JIT, with the GPU's capability faked
(no GPU here)."""

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

import jitk
from jitk.build import builder as build
from jitk.build import cache, toolchain
from jitk.tools import precompile

FLEET = "8.0 9.0 10.0 12.0"  # A100, H100/H200, B200, RTX Blackwell

KERNEL = textwrap.dedent("""\
    #include <jitk/utils.cuh>
    __global__ void twice(int* x) { x[threadIdx.x] *= 2; }
    int twice_host(int x) { return 2 * x; }
""")

# Runs in a fresh process: fakes a GPU of the given capability, then loads the modules.
FAKE_GPU_LOADER = textwrap.dedent("""\
    import importlib, sys, types
    import torch
    capability = tuple(int(part) for part in sys.argv[1].split("."))
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda device=None: capability
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_name = lambda device=None: "a faked GPU"
    # what the tuning store keys shipped tables by: a GPU no table is for
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
        name="a faked GPU", multi_processor_count=1)
    import jitk
    import jitk.build.jit, jitk.tools.precompile
    if sys.argv[2] == "shipped":
        for name in jitk.tools.precompile.KERNEL_MODULES:
            importlib.import_module(name).precompile_configs()[0][1]()
    else:
        jitk.load_jit("twice", cuda_files=[sys.argv[2]], cuda_wrappers=[("f", "twice_host")])
    print("loaded; built", jitk.build.jit.build_count())
""")


def run_python(code: str, *args: str, env: dict, timeout: float = 600):
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def clean_env(cache_dir, **settings):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JITK_")}
    return {**env, "JITK_CACHE_DIR": str(cache_dir), **settings}


def entry_archs(cache_dir):
    return sorted(tuple(e.archs) for e in cache.list_entries(cache_dir))


def test_architecture_sets_and_what_serves_what():
    assert toolchain.canonical_archs(("9.0", "8.0", "9.0", "9.0a")) == ("8.0", "9.0", "9.0a")
    assert toolchain.archs_tag(("10.0", "8.0", "9.0a")) == "sm80-90a-100"
    assert toolchain.ptx_arch(("8.0", "10.0a", "9.0")) == "9.0"  # the newest generic one
    assert toolchain.ptx_arch(("9.0",)) is None  # one architecture: machine code only
    assert build.gencode_flags(("8.0", "12.0")) == [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_120,code=sm_120",
        "-gencode=arch=compute_120,code=compute_120"]  # PTX of the newest, for newer GPUs
    assert build.gencode_flags(("9.0",)) == ["-gencode=arch=compute_90,code=sm_90"]
    fat = ("8.0", "9.0", "10.0")
    assert toolchain.serves(fat, "9.0") == "sass"
    assert toolchain.serves(fat, "8.6") == "sass"  # sm_80 code runs on 8.x
    assert toolchain.serves(fat, "12.0") == "ptx"  # compute_100 PTX, compiled by the driver
    assert toolchain.serves(fat, "7.5") is None
    assert toolchain.serves(fat, "9.0a") is None  # architecture-specific: only itself
    assert toolchain.serves(("9.0",), "12.0") is None


def test_a_kernel_refuses_an_architecture_it_cannot_build_for(tmp_path, monkeypatch):
    kernel = tmp_path / "twice.cuh"
    kernel.write_text(KERNEL)
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("JITK_CUDA_ARCH", "8.0 9.0 8.6")
    with pytest.raises(jitk.ToolchainError, match=r"module 'needs_hopper' cannot be built for "
                       r"sm_80, sm_86: it needs sm_90 or newer"):
        jitk.load_jit("needs_hopper", cuda_files=[kernel], cuda_wrappers=[("f", "twice_host")],
                      min_arch="9.0")
    with pytest.raises(ValueError, match=r"min_arch=...\): expected one architecture"):
        jitk.load_jit("needs_hopper", cuda_files=[kernel], cuda_wrappers=[("f", "twice_host")],
                      min_arch="sm_90")
    assert not (tmp_path / "cache").exists()  # refused before anything was written


def test_one_fat_entry_serves_other_gpus_without_compiling(tmp_path):
    kernel = tmp_path / "twice.cuh"
    kernel.write_text(KERNEL)
    cache_dir = tmp_path / "cache"
    fill = run_python(FAKE_GPU_LOADER, "9.0", str(kernel),
                      env=clean_env(cache_dir, JITK_CUDA_ARCH="8.0;10.0 9.0"))
    assert fill.returncode == 0, fill.stderr
    assert entry_archs(cache_dir) == [("8.0", "9.0", "10.0")]
    (entry,) = cache.list_entries(cache_dir)  # the build key's first 16 digits, then the tag
    assert re.fullmatch(r"twice_[0-9a-f]{16}_sm80-90-100", entry.path.name), entry.path.name

    serving = clean_env(cache_dir, JITK_DISABLE_JIT="1", JITK_VERBOSE="1")
    for capability in ("9.0", "8.6", "10.0"):  # machine code for each
        served = run_python(FAKE_GPU_LOADER, capability, str(kernel), env=serving)
        assert served.returncode == 0, served.stderr
        assert "loaded; built 0" in served.stdout
        assert "PTX" not in served.stderr
    newer = run_python(FAKE_GPU_LOADER, "12.0", str(kernel), env=serving)
    assert newer.returncode == 0, newer.stderr
    assert newer.stderr.count("no machine code for sm_120; the driver compiles its "
                              "compute_100 PTX") == 1
    older = run_python(FAKE_GPU_LOADER, "7.5", str(kernel), env=serving)
    assert older.returncode != 0
    assert "JitCacheMissError" in older.stderr and "architectures: sm_75" in older.stderr
    assert entry_archs(cache_dir) == [("8.0", "9.0", "10.0")]  # nothing was added


def test_a_build_directory_is_rebuilt_for_other_architectures(tmp_path, monkeypatch):
    kernel = tmp_path / "twice.cuh"
    kernel.write_text(KERNEL)
    build = tmp_path / "build"

    def load(archs):
        monkeypatch.setenv("JITK_CUDA_ARCH", archs)
        before = jitk.build.jit.build_count()
        module = jitk.load_jit("twice", cuda_files=[kernel], cuda_wrappers=[("f", "twice_host")],
                               build_directory=build)
        assert module.f(4) == 8
        return jitk.build.jit.build_count() - before, cache.read_meta(build)["archs"]

    assert load("9.0") == (1, ["9.0"])
    assert load("9.0") == (0, ["9.0"])
    assert load("8.0 9.0") == (1, ["8.0", "9.0"])  # the record's key holds the architectures


def test_every_shipped_kernel_builds_for_the_whole_fleet(tmp_path):
    """One fat build of each shipped module's first configuration (the CI's compile check for
    sm_80, sm_90, sm_100 and sm_120), then a faked H100 and a faked RTX Blackwell load them
    from that cache alone."""
    cache_dir = tmp_path / "cache"
    started = time.perf_counter()
    fill = run_python(FAKE_GPU_LOADER, "9.0", "shipped",
                      env=clean_env(cache_dir, JITK_CUDA_ARCH=FLEET))
    assert fill.returncode == 0, fill.stderr
    print(f"fat builds of {len(precompile.KERNEL_MODULES)} modules for {FLEET}: "
          f"{time.perf_counter() - started:.1f} s")
    entries = cache.list_entries(cache_dir)
    assert {e.archs for e in entries} == {("8.0", "9.0", "10.0", "12.0")}
    assert len(entries) >= len(precompile.KERNEL_MODULES)
    for entry in entries:  # every shipped module builds the new way: no nvcc unit (cuda.cu)
        names = {path.name for path in entry.path.iterdir()}
        assert "cuda.cu" not in names and "host_half.cpp" in names, (entry.path.name, names)
        if any(name.endswith(".kernels") for name in names):  # NVRTC's code beside the library
            for code in (".0.sm_80.cubin", ".0.sm_90.cubin", ".0.sm_100.cubin",
                         ".0.sm_120.cubin", ".0.compute_120.ptx"):
                assert any(name.endswith(code) for name in names), (code, names)

    serving = clean_env(cache_dir, JITK_DISABLE_JIT="1")
    for capability in ("9.0", "12.0"):
        served = run_python(FAKE_GPU_LOADER, capability, "shipped", env=serving)
        assert served.returncode == 0, served.stderr
        assert "loaded; built 0" in served.stdout


@pytest.mark.gpu
def test_fat_entry_runs_on_this_gpu(tmp_path):
    """On the device: a cache holding only a fat rmsnorm serves this GPU, and it computes."""
    cache_dir = tmp_path / "cache"
    fill = run_python("import jitk.kernels.norm as n; n.precompile_configs()[1][1]()",
                      env=clean_env(cache_dir, JITK_CUDA_ARCH="8.0 9.0 10.0"))
    assert fill.returncode == 0, fill.stderr
    check = textwrap.dedent("""\
        import torch, jitk
        x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.rms_norm(x.float(), (4096,), w.float(), 1e-6)
        torch.testing.assert_close(jitk.rmsnorm(x, w).float(), ref, atol=2e-2, rtol=2e-2)
        print("built", jitk.build.jit.build_count())
    """)
    served = run_python(check, env=clean_env(cache_dir, JITK_DISABLE_JIT="1"))
    assert served.returncode == 0, served.stderr
    assert "built 0" in served.stdout
