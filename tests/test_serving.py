"""Serving from a cache filled elsewhere: JITK_DISABLE_JIT / jitk.disable_jit() turn a miss
into JitCacheMissError at once, and a cache filled by one installation of jitk is hit by
another installed elsewhere."""

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import jitk
from jitk.build import cache
from jitk.tools import precompile

PACKAGE = Path(jitk.__file__).resolve().parent


@pytest.fixture
def kernel(tmp_path) -> Path:
    path = tmp_path / "twice.cuh"
    path.write_text("#include <cstdint>\nint64_t twice(int64_t x) { return 2 * x; }\n")
    return path


def load(kernel: Path, *template_args: str):
    return jitk.load_jit("twice", *template_args, cpp_files=[kernel],
                         cpp_wrappers=[("twice", "twice")])


def test_disable_jit_setting_turns_a_miss_into_an_error_at_once(kernel, tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("JITK_DISABLE_JIT", "1")
    started = time.perf_counter()
    with pytest.raises(jitk.JitCacheMissError) as info:
        load(kernel, "64")
    assert time.perf_counter() - started < 0.5
    message = str(info.value)
    assert isinstance(info.value, RuntimeError)
    for fragment in ("module 'twice_64'", "template arguments: 64", "architectures: host only",
                     "it is not in the cache", "JITK_DISABLE_JIT=1", "python -m jitk precompile"):
        assert fragment in message, message
    assert not (tmp_path / "cache").exists()  # nothing built, locked or written

    monkeypatch.setenv("JITK_DISABLE_JIT", "0")
    assert load(kernel, "64").twice(4) == 8
    monkeypatch.setenv("JITK_DISABLE_JIT", "1")
    assert load(kernel, "64").twice(5) == 10  # a hit loads as usual


def test_disable_jit_context_and_a_damaged_entry(kernel, tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "cache"))
    assert load(kernel).twice(1) == 2
    with jitk.disable_jit():
        assert load(kernel).twice(2) == 4
        with pytest.raises(jitk.JitCacheMissError, match="not in the cache"):
            load(kernel, "other")
        [library] = (tmp_path / "cache").glob("*/twice.so")
        # A new file in its place: truncating the mapped one would crash this process.
        damaged = library.with_suffix(".damaged")
        damaged.write_bytes(library.read_bytes()[:100])
        damaged.replace(library)
        with pytest.raises(jitk.JitCacheMissError, match="its entry cannot be used: twice.so "
                           "is damaged"):
            load(kernel)
    assert load(kernel).twice(3) == 6  # enabled again: rebuilt
    assert cache.is_complete(library.parent, cache.read_meta(library.parent)["key"])


def test_disable_jit_setting_is_checked(kernel, monkeypatch):
    monkeypatch.setenv("JITK_DISABLE_JIT", "maybe")
    with pytest.raises(ValueError, match="JITK_DISABLE_JIT='maybe'"):
        load(kernel, "checked")


def printed_command(error: jitk.JitCacheMissError) -> list[str]:
    """The command a miss's message gives to fill its entry, ready for subprocess.run."""
    command = shlex.split(str(error).split("`")[1])
    assert command[:4] == ["python", "-m", "jitk", "precompile"], command
    return [sys.executable, *command[1:]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="builds for sm_90 without a GPU")
def test_a_kernel_modules_miss_names_the_command_for_its_own_configuration(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "cache"))
    x, weight = torch.randn(2, 4104, dtype=torch.bfloat16), torch.randn(4104, dtype=torch.bfloat16)
    with jitk.disable_jit(), pytest.raises(jitk.JitCacheMissError) as info:
        jitk.rmsnorm(x, weight)  # 4104 is not among precompile_configs()
    message = str(info.value)
    assert "template arguments: 4104, bf16_t; architectures: sm_90" in message, message
    command = printed_command(info.value)
    assert command[4:6] == ["--arch", "9.0"] and command[6] == "--call"
    call = precompile.read_call(command[7])
    assert call["name_parts"] == ["rmsnorm", "4104", "bf16_t"]
    assert call["cuda_files"] == ["rmsnorm.cuh"]  # the package's own file, by its name


def test_the_printed_command_fills_exactly_the_missing_entry(tmp_path, monkeypatch):
    kernel = tmp_path / "scaled.cuh"
    kernel.write_text("#include <cstdint>\ntemplate <int64_t kScale>\n"
                      "int64_t scaled(int64_t x) { return kScale * x; }\n")
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("JITK_CUDA_ARCH", "9.0")

    def load_scaled():
        return jitk.load_jit("scaled", 3, cuda_files=[kernel],
                             cuda_wrappers=[("scaled", "scaled<3>")])

    with jitk.disable_jit(), pytest.raises(jitk.JitCacheMissError) as info:
        load_scaled()
    filled = subprocess.run(printed_command(info.value), cwd=tmp_path, capture_output=True,
                            text=True, timeout=600, env={**os.environ, "JITK_DISABLE_JIT": "1"})
    assert filled.returncode == 0, filled.stdout + filled.stderr
    assert "(1 built, 0 cached)" in filled.stdout
    monkeypatch.setenv("JITK_DISABLE_JIT", "1")
    assert load_scaled().scaled(5) == 15  # a hit, with compiling off
    assert len(cache.list_entries(tmp_path / "cache")) == 1


def copy_package(destination: Path) -> Path:
    shutil.copytree(PACKAGE, destination / "jitk", ignore=shutil.ignore_patterns("__pycache__"))
    return destination


LOAD_SHIPPED = """
import jitk, jitk.kernels.wait_value
label, thunk = jitk.kernels.wait_value.precompile_configs()[0]
thunk()
print("loaded from", jitk.__file__)
"""


def test_two_installations_share_one_cache(tmp_path):
    """A second copy of jitk at another path hits what the first built: keys name shipped
    files by their place in the package."""
    cache_dir = tmp_path / "cache"
    runs = []
    for name in ("first", "second"):
        install = copy_package(tmp_path / name)
        # The copy comes first on the path; what else the path holds (tvm-ffi, say) stays.
        path = os.pathsep.join(filter(None, [str(install), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, "JITK_CACHE_DIR": str(cache_dir),
               "JITK_CUDA_ARCH": "9.0", "JITK_VERBOSE": "1", "CUDA_VISIBLE_DEVICES": ""}
        runs.append(subprocess.run([sys.executable, "-c", LOAD_SHIPPED], capture_output=True,
                                   text=True, timeout=300, env=env, cwd=tmp_path))
    for run, name in zip(runs, ("first", "second")):
        assert run.returncode == 0, run.stderr
        assert f"loaded from {tmp_path / name / 'jitk'}" in run.stdout
    assert "jitk: built wait_value" in runs[0].stderr
    assert "jitk: built" not in runs[1].stderr
    [entry] = cache.list_entries(cache_dir)
    meta = json.loads((entry.path / cache.META_FILE).read_text())
    # The headers it read are recorded by their place in the package, so either copy's
    # lookup checks its own files and hits.
    assert meta["headers"] and all(name.startswith("<jitk>/") for name in meta["headers"])
