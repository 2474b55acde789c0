"""The build itself (jitk/build/builder.py): builds in several threads at once, paths that the shell
and ninja would read otherwise, ninja's own failures, the guard's messages, and the
compilers in the cache key."""

import json
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import jitk
import jitk.build.jit
from jitk.build import builder as build
from jitk.build import toolchain
from jitk.build.cache import META_FILE, PACKAGE_MARK, list_entries

AXPY = Path(__file__).resolve().parent / "csrc" / "cpu_axpy.h"
# A space, a shell variable, a colon (ninja's and make's separator), non-ASCII, a quote.
ODD = "odd $HOME: ü 'q'"
# nvcc passes -I folders to its steps' shell with a quote mangled (13.0): not in those.
ODD_FOR_NVCC = "odd $HOME: ü"


def load_axpy(name: str):
    return jitk.load_jit(name, cpp_files=[AXPY], cpp_wrappers=[("axpy", "cpu_axpy::axpy")])


def test_threads_cold_building_different_modules_build_each_once(tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("JITK_LOCK_TIMEOUT", "150")
    names = ["threaded_a", "threaded_b", "threaded_c"]
    start = threading.Barrier(8)

    def load_all(thread: int) -> list:
        start.wait(timeout=60)
        order = names[thread % 3:] + names[:thread % 3]  # the threads start on all three
        return [load_axpy(name) for name in order]

    before = jitk.build.jit.build_count()
    with ThreadPoolExecutor(8) as pool:
        loaded = [f.result(timeout=300) for f in [pool.submit(load_all, t) for t in range(8)]]
    assert jitk.build.jit.build_count() - before == 3
    assert sorted(entry.module for entry in list_entries(tmp_path / "cache")) == names
    for modules in loaded:
        for module in modules:
            y = torch.ones(4)
            module.axpy(2.0, torch.arange(4.0), y)
            assert y.tolist() == [1.0, 3.0, 5.0, 7.0]


def write_odd_kernel(root: Path, value: int, odd_include: str) -> tuple[Path, Path]:
    """A kernel in a folder named ODD, and the include folder of its header."""
    include = root / f"include {odd_include}"
    include.mkdir(parents=True, exist_ok=True)
    (include / "odd_value.h").write_text(f"constexpr long kOdd = {value};\n")
    kernel = root / f"kernel {ODD}" / "odd.cuh"
    kernel.parent.mkdir(parents=True, exist_ok=True)
    kernel.write_text('#include "odd_value.h"\n#include <cstdint>\n'
                      "int64_t odd_scaled(int64_t x) { return x * kOdd; }\n")
    return kernel, include


def load_odd(kernel: Path, include: Path, language: str):
    return jitk.load_jit("odd", language, **{f"{language}_files": [kernel],
                                            f"{language}_wrappers": [("scaled", "odd_scaled")]},
                         extra_include_paths=[include])


def recorded_headers(cache: Path, name: str) -> list[str]:
    [entry] = [e for e in list_entries(cache) if e.module == name]
    return list(json.loads((entry.path / META_FILE).read_text())["headers"])


@pytest.mark.parametrize("language", ["cpp", "cuda"])
def test_paths_with_spaces_dollars_colons_and_non_ascii_build(language, tmp_path, monkeypatch):
    cache = tmp_path / f"jit cache {ODD}"
    monkeypatch.setenv("JITK_CACHE_DIR", str(cache))
    odd_include = ODD if language == "cpp" else ODD_FOR_NVCC
    kernel, include = write_odd_kernel(tmp_path, 7, odd_include)
    assert load_odd(kernel, include, language).scaled(3) == 21
    # ninja's record of the headers read the folder right: the header is checked on loads,
    # as are jitk's own, recorded wherever the package is installed.
    recorded = recorded_headers(cache, f"odd_{language}")
    assert [h for h in recorded if not h.startswith(PACKAGE_MARK)] == [str(include / "odd_value.h")]
    assert f"{PACKAGE_MARK}/include/jitk/export.h" in recorded
    if language == "cuda":  # nvcc's command line: one CUDA build only, it is slow
        [entry] = list_entries(cache)
        assert "-ccbin" in (entry.path / "build.ninja").read_text()
        return
    write_odd_kernel(tmp_path, 8, odd_include)  # an edit of the header rebuilds
    before = jitk.build.jit.build_count()
    assert load_odd(kernel, include, language).scaled(3) == 24
    assert jitk.build.jit.build_count() == before + 1


def test_a_failure_before_any_compiler_runs_names_ninja_and_its_error(tmp_path):
    (tmp_path / "build.ninja").write_text("rule copy\n  command = cp $in $out\n"
                                          "build out: copy missing.txt\n")
    with pytest.raises(jitk.JitCompileError) as info:
        build._run_ninja("copied", tmp_path)
    assert info.value.errors == ["ninja: error: 'missing.txt', needed by 'out', missing and no "
                                 "known rule to make it"]
    assert info.value.command == f"cd {tmp_path} && {toolchain.ninja()} -v"


def test_the_guard_says_why_it_did_not_start_the_build():
    # Its builder (pid 1 here) is not its parent: the builder is gone.
    result = subprocess.run([sys.executable, "-I", str(build.GUARD), "1", "10",
                             shutil.which("ninja"), "--version"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert result.stderr == ("jitk: the process that started this build (pid 1) is gone, so "
                             "the build did not start\n")


def miss_entry(**env: str) -> str:
    """The entry a CUDA module would have under `env` (no build: JIT is disabled)."""
    with pytest.MonkeyPatch.context() as patch, jitk.disable_jit():
        for name, value in env.items():
            patch.setenv(name, value)
        with pytest.raises(jitk.JitCacheMissError) as info:
            jitk.load_jit("key_probe", cuda_files=[AXPY], cuda_wrappers=[("f", "cpu_axpy::axpy")])
    return str(info.value).split("it is not in the cache (")[1].split(")")[0]


def test_the_cache_key_holds_the_host_compiler_nvcc_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "cache"))
    other = tmp_path / "gcc"
    other.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "gcc (another) 99.1" && exit 0\n'
                     'exec gcc "$@"\n')
    other.chmod(0o755)
    assert miss_entry() == miss_entry(NVCC_CCBIN=shutil.which("gcc"))
    assert miss_entry(NVCC_CCBIN=str(other)) != miss_entry()
    assert miss_entry(NVCC_CCBIN=str(tmp_path)) == miss_entry(NVCC_CCBIN=str(other))  # a folder
