"""load_jit, make_cpp_args and the disk cache: hits, rebuilds on header edits and only then,
one build for concurrent processes, failed builds not cached, corrupt entries rebuilt."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from errors import expect_error

import jitk
import jitk.build.jit
from jitk.build import toolchain
from jitk.build.cache import META_FILE, list_entries

KERNEL = textwrap.dedent("""\
    #include <jitk/utils.h>
    #include "scale.h"
    #include <cstdint>
    int64_t scaled(int64_t x) {
      jitk::RuntimeCheck(x >= 0, "x must not be negative, got ", x);
      return x * kScale;
    }
""")


def write_kernel(folder: Path, scale: int = 3) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "scale.h").write_text(f"constexpr long kScale = {scale};\n")
    kernel = folder / "scaled.cuh"
    kernel.write_text(KERNEL)
    return kernel


LOAD_SNIPPET = textwrap.dedent("""\
    import sys
    sys.modules["torch"] = None  # keeps tvm-ffi from importing torch: a faster start
    import jitk
    module = jitk.load_jit("scaled", cpp_files=[sys.argv[1]], cpp_wrappers=[("scaled", "scaled")])
    print("result", module.scaled(int(sys.argv[2])))
""")


def run_loader(kernel: Path, cache: Path, x: int = 5, extra_env=None,
               snippet: str = LOAD_SNIPPET) -> subprocess.CompletedProcess:
    """load_jit in a fresh process, with build logging on."""
    env = {**os.environ, "JITK_CACHE_DIR": str(cache), "JITK_VERBOSE": "1", **(extra_env or {})}
    return subprocess.run([sys.executable, "-c", snippet, str(kernel), str(x)],
                          capture_output=True, text=True, env=env, timeout=300)


def builds_in(result: subprocess.CompletedProcess) -> int:
    assert result.returncode == 0, result.stderr
    return result.stderr.count("jitk: built scaled")


# ------------------------------------------------------------------------------ cpp args
def test_make_cpp_args_renders_template_arguments():
    args = jitk.make_cpp_args(128, True, False, 0.5, 1e-6, torch.bfloat16, torch.float16,
                              torch.float32, torch.int64)
    assert tuple(args) == ("128", "true", "false", "0.5", "1e-06", "bf16_t", "fp16_t", "fp32_t",
                           "int64_t")
    assert str(jitk.make_cpp_args(4096, torch.bfloat16)) == "4096, bf16_t"
    assert str(jitk.make_cpp_args()) == ""


def test_make_cpp_args_rejects_what_has_no_cpp_form():
    with pytest.raises(TypeError, match="argument 1 has type str"):
        jitk.make_cpp_args(1, "bf16")
    with pytest.raises(ValueError, match="argument 0 is nan"):
        jitk.make_cpp_args(float("nan"))
    with pytest.raises(TypeError, match="complex64 has no C\\+\\+ type"):
        jitk.make_cpp_args(torch.complex64)


# ------------------------------------------------------------------------------ arguments
def test_load_jit_argument_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'.*kernels/nope.cuh' not found \(a path that "
                       "is not absolute names a file in the jitk package; give an absolute "
                       "path for your own"):
        jitk.load_jit("x", cuda_files=["nope.cuh"], cuda_wrappers=[("f", "f")])
    missing = tmp_path / "missing.cuh"
    with pytest.raises(FileNotFoundError, match=f"'{missing}' not found$"):
        jitk.load_jit("x", cpp_files=[missing], cpp_wrappers=[("f", "f")])
    with pytest.raises(IsADirectoryError, match=f"'{tmp_path}' is a folder; give the kernel "
                       "files in it"):
        jitk.load_jit("x", cuda_files=[tmp_path], cuda_wrappers=[("f", "f")])
    kernel = write_kernel(tmp_path)
    with pytest.raises(ValueError, match="would export nothing"):
        jitk.load_jit("x", cpp_files=[kernel])
    with pytest.raises(ValueError, match="'not-an-identifier' is not a C identifier"):
        jitk.load_jit("x", cpp_files=[kernel], cpp_wrappers=[("not-an-identifier", "f")])
    with pytest.raises(TypeError, match="expected \\(export_name, cpp_callable\\)"):
        jitk.load_jit("x", cpp_files=[kernel], cpp_wrappers=["scaled"])
    with pytest.raises(ValueError, match="at least one name part"):
        jitk.load_jit(cpp_files=[kernel], cpp_wrappers=[("f", "f")])


def wrapped(**overrides):
    """load_jit of a valid C++ module with one argument replaced."""
    kernel = Path(__file__).resolve().parent / "csrc" / "header_probe.cuh"
    arguments = {"cpp_files": [kernel], "cpp_wrappers": [("positive", "probe::positive")],
                 **overrides}
    return lambda: jitk.load_jit(*arguments.pop("name_parts", ("args",)), **arguments)


@pytest.mark.parametrize("overrides, kind, message", [
    ({"name_parts": ("x", None)}, TypeError, "name part 1 is NoneType"),
    ({"name_parts": ("x", 1.5)}, TypeError, "name part 1 is float"),
    ({"name_parts": ("x", True)}, TypeError, "name part 1 is bool"),
    ({"name_parts": ("x" * 201,)}, ValueError, "at most 200 fit a folder name"),
    ({"cpp_files": "probe.cuh"}, TypeError, "load_jit(cpp_files=...) takes a list of paths "
     "(str or os.PathLike), got str; write cpp_files=['probe.cuh']"),
    ({"cpp_files": [None]}, TypeError, "load_jit(cpp_files[0]): expected paths (str or "
     "os.PathLike), got NoneType"),
    ({"cuda_files": 5}, TypeError, "load_jit(cuda_files=...) takes a list of paths"),
    ({"cuda_wrappers": "axpy"}, TypeError, "load_jit(cuda_wrappers=...) takes a list of "
     "(export_name, cpp_callable), got str; write cuda_wrappers=[('axpy', '<C++ function or "
     "static member>')]"),
    ({"cpp_wrappers": [("f",)]}, TypeError, "expected (export_name, cpp_callable) as two"),
    ({"cpp_wrappers": [("f", 3)]}, TypeError, "expected (export_name, cpp_callable) as two"),
    ({"cpp_wrappers": [("f", "")]}, ValueError, "'' for 'f' is not a C++ name"),
    ({"cpp_wrappers": [("f", "probe::positive"), ("f", "probe::pair")]}, ValueError,
     "export name(s) f given twice"),
    ({"extra_cflags": "-O2"}, TypeError, "load_jit(extra_cflags=...) takes a list of strings"),
    ({"extra_ldflags": [1]}, TypeError, "load_jit(extra_ldflags[0]): expected strings, got int"),
    ({"extra_include_paths": [3.0]}, TypeError, "load_jit(extra_include_paths[0]): expected "
     "paths"),
    ({"build_directory": 7}, TypeError, "load_jit(build_directory=...): expected a path or "
     "None, got int"),
], ids=lambda value: str(value)[:40] if isinstance(value, dict) else "")
def test_load_jit_names_the_bad_argument(overrides, kind, message, tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "cache"))
    expect_error(wrapped(**overrides), message, kind=kind)
    assert not (tmp_path / "cache").exists()  # refused before anything was written


def test_unsupported_architecture_is_refused_before_building(tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("JITK_CUDA_ARCH", "7.0")
    with pytest.raises(jitk.ToolchainError, match=r"cannot build for sm_70; it supports compute "
                       r"capabilities 7\.5, 8\.0, .*9\.0"):
        jitk.load_jit("old_gpu", cuda_files=[write_kernel(tmp_path / "repo")],
                      cuda_wrappers=[("f", "scaled")])
    assert not (tmp_path / "cache").exists()
    assert "9.0" in toolchain.supported_archs()


@pytest.mark.parametrize("flags, decisive", [
    # nvcc asked for an architecture it cannot build: its fatal line, not the log's tail.
    ({"extra_cuda_cflags": ["-gencode=arch=compute_70,code=sm_70"]},
     "nvcc fatal   : Unsupported gpu architecture 'compute_70'"),
    # The linker, told to refuse undefined symbols.
    ({"extra_ldflags": ["-Wl,--no-undefined"]}, "undefined reference to `missing()'"),
    # Left undefined, the library fails to load: the loader's line.
    ({}, "undefined symbol: _Z7missingv"),
])
def test_compile_error_holds_the_decisive_line(flags, decisive, tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "cache"))
    kernel = tmp_path / "missing.cuh"
    kernel.write_text("#include <cstdint>\nint64_t missing();\nint64_t f() { return missing(); }\n")
    files = "cuda_files" if "extra_cuda_cflags" in flags else "cpp_files"
    wrappers = "cuda_wrappers" if files == "cuda_files" else "cpp_wrappers"
    with pytest.raises(jitk.JitCompileError) as info:
        jitk.load_jit("missing", **{files: [kernel], wrappers: [("f", "f")]}, **flags)
    assert any(decisive in line for line in info.value.errors), info.value.log
    assert list_entries(tmp_path / "cache") == []


def test_arch_setting_is_validated(monkeypatch):
    assert toolchain.parse_archs("9.0") == ("9.0",)
    assert toolchain.parse_archs("9.0a;8.0") == ("9.0a", "8.0")
    assert toolchain.parse_archs(" 8.6, 9.0 ") == ("8.6", "9.0")
    monkeypatch.setenv("JITK_CUDA_ARCH", "sm90")
    with pytest.raises(jitk.ToolchainError, match="JITK_CUDA_ARCH='sm90'"):
        toolchain.target_archs()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_build_without_gpu_or_arch_says_what_to_set(monkeypatch, tmp_path):
    monkeypatch.delenv("JITK_CUDA_ARCH", raising=False)
    with pytest.raises(jitk.ToolchainError, match="no CUDA GPU is visible.*set JITK_CUDA_ARCH"):
        jitk.load_jit("no_arch", cuda_files=[write_kernel(tmp_path)],
                      cuda_wrappers=[("f", "scaled")])


def test_machine_code_compatibility_rules():
    assert toolchain.runs_on(("9.0",), (9, 0))
    assert toolchain.runs_on(("8.0",), (8, 6))
    assert not toolchain.runs_on(("8.6",), (8, 0))
    assert not toolchain.runs_on(("8.0",), (9, 0))
    assert toolchain.runs_on(("9.0a",), (9, 0))
    assert not toolchain.runs_on(("10.0a",), (10, 3))
    assert toolchain.runs_on(("10.0f",), (10, 3))
    assert toolchain.runs_on(("8.0", "9.0"), (9, 0))


def test_wrong_architecture_is_caught_at_load_naming_both(monkeypatch):
    monkeypatch.setattr(toolchain, "current_gpu_capability", lambda: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    with pytest.raises(jitk.ToolchainError, match="holds code for sm_80, but the current GPU "
                       r"\(cuda:0, NVIDIA H100\) is sm_90"):
        toolchain.check_runs_on_current_gpu("rmsnorm", ("8.0",))
    toolchain.check_runs_on_current_gpu("rmsnorm", ("9.0",))


# ------------------------------------------------------------------------------ toolkit
def test_cuda_toolkit_found_through_a_wrapper_script(monkeypatch):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    found = toolchain.cuda_home.__wrapped__()
    assert (found / "include" / "cuda_runtime.h").is_file()
    assert (found / "lib64").is_dir() or (found / "lib").is_dir()
    # Whatever nvcc on PATH is (here, a shell script that execs the real one), asking it
    # gives the toolkit whose nvcc is the real compiler.
    asked = toolchain._root_reported_by_nvcc(shutil.which("nvcc"))
    assert (asked / "include" / "cuda_runtime.h").is_file()
    assert (asked / "bin" / "nvcc").read_bytes()[:4] == b"\x7fELF"


def test_wrong_cuda_home_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    with pytest.raises(jitk.ToolchainError, match=f"CUDA_HOME={tmp_path} is not a CUDA toolkit"):
        toolchain.cuda_home.__wrapped__()


# ------------------------------------------------------------------------------ cache
def test_user_kernel_outside_the_package_loads_and_validates(tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "cache"))
    kernel = write_kernel(tmp_path / "repo")
    module = jitk.load_jit("scaled", cpp_files=[kernel], cpp_wrappers=[("scaled", "scaled")])
    assert module.scaled(7) == 21
    with pytest.raises(RuntimeError, match="Runtime check failed at scaled.cuh:5: x must not be "
                                           "negative, got -1"):
        module.scaled(-1)
    [entry] = list_entries(tmp_path / "cache")
    assert entry.module == "scaled" and entry.archs == () and entry.size_bytes > 0


def test_cache_hit_in_a_new_process_builds_nothing(tmp_path):
    kernel = write_kernel(tmp_path / "repo")
    assert builds_in(run_loader(kernel, tmp_path / "cache")) == 1
    second = run_loader(kernel, tmp_path / "cache")
    assert builds_in(second) == 0
    assert "result 15" in second.stdout


def test_editing_an_included_user_header_rebuilds(tmp_path):
    kernel = write_kernel(tmp_path / "repo", scale=3)
    assert "result 15" in run_loader(kernel, tmp_path / "cache").stdout
    write_kernel(tmp_path / "repo", scale=4)
    result = run_loader(kernel, tmp_path / "cache")
    assert builds_in(result) == 1 and "result 20" in result.stdout


def test_a_jitk_header_edit_rebuilds_only_the_entries_that_read_it(tmp_path, monkeypatch):
    include = tmp_path / "include"
    shutil.copytree(jitk.build.jit.INCLUDE_DIR, include)
    monkeypatch.setattr(jitk.build.jit, "INCLUDE_DIR", include)
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "cache"))
    plain = write_kernel(tmp_path / "plain")
    with_rows = tmp_path / "rows" / "with_rows.cuh"
    with_rows.parent.mkdir()
    with_rows.write_text("#include <jitk/rows.h>\n#include <cstdint>\n"
                         "int64_t twice(int64_t x) { return 2 * x; }\n")
    loads = {"scaled": lambda: jitk.load_jit("scaled", cpp_files=[plain],
                                             cpp_wrappers=[("scaled", "scaled")]).scaled(5),
             "twice": lambda: jitk.load_jit("twice", cpp_files=[with_rows],
                                            cpp_wrappers=[("twice", "twice")]).twice(5)}

    def rebuilt() -> set[str]:
        built = set()
        for name, load in loads.items():
            before = jitk.build.jit.build_count()
            assert load() == {"scaled": 15, "twice": 10}[name]
            if jitk.build.jit.build_count() > before:
                built.add(name)
        return built

    def append_comment(header: str) -> None:
        with (include / "jitk" / header).open("a") as file:
            file.write("\n// an edit\n")

    assert rebuilt() == {"scaled", "twice"}
    assert rebuilt() == set()
    append_comment("rows.h")  # only `twice` reads it
    assert rebuilt() == {"twice"}
    append_comment("persistent.cuh")  # nobody reads it
    assert rebuilt() == set()
    append_comment("utils.h")  # both read it, through jitk/export.h
    assert rebuilt() == {"scaled", "twice"}
    assert len(list_entries(tmp_path / "cache")) == 2  # each rebuild replaced its entry


def test_concurrent_processes_build_once(tmp_path):
    kernel = write_kernel(tmp_path / "repo")
    env = {**os.environ, "JITK_CACHE_DIR": str(tmp_path / "cache"), "JITK_VERBOSE": "1"}
    ranks = [subprocess.Popen([sys.executable, "-c", LOAD_SNIPPET, str(kernel), str(rank)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank in range(8)]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), outputs
    assert sum(err.count("jitk: built scaled") for _, err in outputs) == 1
    assert sorted(out.strip() for out, _ in outputs) == sorted(f"result {3 * r}"
                                                               for r in range(8))


def test_failed_build_raises_compiler_lines_and_caches_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("JITK_STAGING_DIR", str(tmp_path / "staging"))
    broken = tmp_path / "broken.cuh"
    broken.write_text("#include <jitk/utils.h>\nint64_t f(int64_t x) { return x + undeclared; }\n")
    for _ in range(2):  # the second attempt compiles again: nothing was remembered
        with pytest.raises(jitk.JitCompileError) as info:
            jitk.load_jit("broken", cpp_files=[broken], cpp_wrappers=[("f", "f")])
        error = info.value
        assert isinstance(error, RuntimeError)
        assert any("broken.cuh:2" in line and "undeclared" in line for line in error.errors)
        assert "c++" in error.command and "main.cpp" in error.command
        assert "undeclared" in str(error) and "command:" in str(error)
    # Nothing published; the failed build stays for inspection until the next build of it.
    assert list_entries(tmp_path / "cache") == []
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir() and p.name[0] != "."]
    assert not (tmp_path / "cache" / ".staging").exists()  # it stays on the builder's host
    [build_dir] = (tmp_path / "staging").iterdir()
    assert (build_dir / "main.cpp").is_file() and str(build_dir) in error.command
    assert not list(build_dir.glob("*.so")) and not (build_dir / META_FILE).exists()


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_cached_library_is_rebuilt(tmp_path, damage):
    kernel = write_kernel(tmp_path / "repo")
    assert builds_in(run_loader(kernel, tmp_path / "cache")) == 1
    [library] = (tmp_path / "cache").glob("*/scaled.so")
    data = library.read_bytes()
    library.write_bytes(data[: len(data) // 3] if damage == "truncate" else b"\x7fELF" + b"x" * 64)
    result = run_loader(kernel, tmp_path / "cache")
    assert builds_in(result) == 1 and "result 15" in result.stdout
    assert "did not load" in result.stderr


def test_verbose_log_names_module_arch_and_seconds(tmp_path):
    kernel = write_kernel(tmp_path / "repo")
    result = run_loader(kernel, tmp_path / "cache")
    assert builds_in(result) == 1
    assert "jitk: built scaled for host only in" in result.stderr and " s (" in result.stderr


# ------------------------------------------------------------------------------ events
EVENTS_SNIPPET = textwrap.dedent("""\
    import json, sys
    import jitk
    for _ in range(2):
        module = jitk.load_jit("scaled", cuda_files=[sys.argv[1]],
                               cuda_wrappers=[("scaled", "scaled")])
    print(json.dumps(jitk.jit_stats()))
""")


def event_stats(kernel: Path, cache: Path, **settings: str) -> dict:
    result = run_loader(kernel, cache, snippet=EVENTS_SNIPPET,
                        extra_env={"JITK_CUDA_ARCH": "9.0", "CUDA_VISIBLE_DEVICES": "",
                                   "JITK_VERBOSE": "", **settings})
    assert result.returncode == 0, result.stderr
    return {**json.loads(result.stdout.splitlines()[-1]), "stderr": result.stderr}


def test_each_load_is_one_event_counted_by_kind_and_shown_at_loglevel_1(tmp_path):
    kernel = write_kernel(tmp_path / "repo")
    first = event_stats(kernel, tmp_path / "cache", JITK_LOGLEVEL="1")
    [entry] = list_entries(tmp_path / "cache")
    key = entry.path.name.split("_")[1]  # the folder's: scaled_<key>_sm90
    assert [(e["module"], e["key"], e["source"]) for e in first["events"]] == [
        ("scaled", key, "build"), ("scaled", key, "disk")]
    assert {kind: first[kind]["count"] for kind in ("build", "disk", "remote", "miss")} == {
        "build": 1, "disk": 1, "remote": 0, "miss": 0}
    for kind, event in zip(("build", "disk"), first["events"], strict=True):
        assert first[kind]["seconds"] == event["seconds"] > 0
    # what the build's time went to: nvcc here (no NVRTC), then the copy and the load
    built, found = first["events"]
    assert list(built["phases"]) == ["compilers", "publish"] and found["phases"] == {}
    assert all(seconds > 0 for seconds in built["phases"].values())
    assert sum(built["phases"].values()) <= built["seconds"]
    lines = [line for line in first["stderr"].splitlines() if line.startswith("jitk: jit ")]
    assert [re.sub(r"\d+\.\d{3}", "<t>", line) for line in lines] == [
        f"jitk: jit build scaled key {key} <t> s (compilers <t>, publish <t>)",
        f"jitk: jit disk scaled key {key} <t> s"]

    second = event_stats(kernel, tmp_path / "cache")  # a new process: the disk cache only
    assert [e["source"] for e in second["events"]] == ["disk", "disk"]
    assert second["build"] == {"count": 0, "seconds": 0.0} and second["disk"]["count"] == 2
    assert "jitk: jit" not in second["stderr"]  # JITK_LOGLEVEL=0


def test_a_load_that_gets_no_module_is_a_miss_and_reset_starts_over(tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "cache"))
    kernel = write_kernel(tmp_path / "repo")
    jitk.jit_stats(reset=True)
    builds = jitk.build.jit.build_count()
    with jitk.disable_jit(), pytest.raises(jitk.JitCacheMissError):
        jitk.load_jit("scaled", cpp_files=[kernel], cpp_wrappers=[("scaled", "scaled")])
    assert jitk.load_jit("scaled", cpp_files=[kernel],
                         cpp_wrappers=[("scaled", "scaled")]).scaled(2) == 6
    stats = jitk.jit_stats(reset=True)
    assert [e["source"] for e in stats["events"]] == ["miss", "build"]
    assert stats["miss"]["count"] == 1 and stats["build"]["count"] == 1
    after = jitk.jit_stats()
    assert after["events"] == [] and after["build"] == {"count": 0, "seconds": 0.0}
    assert jitk.build.jit.build_count() == builds + 1  # counts from the process's start
    expect_error(lambda: jitk.jit_stats(reset="yes"),
                 "jit_stats(reset=...): expected a bool, got str", kind=jitk.ArgumentTypeError)
