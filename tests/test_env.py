"""`python -m jitk env`: a report with the same keys on every machine."""

import json
import os
import subprocess
import sys

import jitk
from jitk.build import cache, nvrtc, remote, toolchain
from jitk.tools import env


def run_env(*args, **settings):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("JITK_")}
    return subprocess.run([sys.executable, "-m", "jitk", "env", *args], capture_output=True,
                          text=True, env={**clean, **settings}, timeout=120)


ENTRY = "m_0123456789abcdef_sm90"


def fake_entry(cache_dir, name=ENTRY):
    entry = cache_dir / name
    entry.mkdir(parents=True)
    (entry / "m.so").write_bytes(b"x" * 1000)
    cache.write_meta(entry, {"module": "m", "library": "m.so", "archs": ["9.0"],
                             "built_at": 0, "sha256": "", "headers": {}})


def assert_stable_keys(report):
    assert tuple(report) == env.KEYS
    assert tuple(report["nvcc"]) == env.NVCC_KEYS
    assert tuple(report["nvrtc"]) == env.NVRTC_KEYS
    assert tuple(report["host_compiler"]) == env.COMPILER_KEYS
    assert tuple(report["nvcc_host_compiler"]) == env.COMPILER_KEYS
    assert tuple(report["target_archs"]) == env.TARGET_KEYS
    assert tuple(report["cache"]) == env.CACHE_KEYS
    assert tuple(report["remote_cache"]) == remote.DESCRIBE_KEYS
    assert all(tuple(gpu) == env.GPU_KEYS for gpu in report["gpus"])


def test_json_report(tmp_path):
    fake_entry(tmp_path / "cache")
    result = run_env("--json", JITK_CUDA_ARCH="9.0;8.0", JITK_CACHE_DIR=str(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert_stable_keys(report)
    assert report["jitk"] == jitk.__version__
    assert report["python"] == sys.version.split()[0]
    assert report["torch"] and report["tvm_ffi"]
    assert report["nvcc"]["error"] is None
    assert report["nvcc"]["version"] == toolchain.compiler_versions([toolchain.nvcc_path()])[0]
    assert os.path.isfile(report["nvcc"]["path"])
    try:
        expected = {"path": nvrtc.library_path(), "version": "{}.{}".format(*nvrtc.version()),
                    "error": None}
    except nvrtc.NvrtcError as error:
        expected = {"path": None, "version": None, "error": str(error)}
    # what load_jit(cuda_compiler="auto") would build with in this process
    assert report["nvrtc"] == {**expected, "auto_builds_with": nvrtc.choose("auto")}
    assert f"two-halves files build with: {nvrtc.choose('auto')}" in env.render(report)
    for key, compiler in (("host_compiler", toolchain.host_compiler()),
                          ("nvcc_host_compiler", toolchain.nvcc_host_compiler())):
        assert report[key]["path"] == compiler
        assert report[key]["version"] == toolchain.compiler_versions([compiler])[0]
    assert report["target_archs"] == {"archs": ["8.0", "9.0"], "source": "JITK_CUDA_ARCH",
                                      "error": None}
    # the entries' bytes: not the compilers' version lines the report's queries kept
    assert report["cache"] == {"dir": str(tmp_path / "cache"), "entries": 1,
                               "bytes": cache.folder_size(tmp_path / "cache" / ENTRY)}
    assert report["settings"] == {"JITK_CACHE_DIR": str(tmp_path / "cache"),
                                  "JITK_CUDA_ARCH": "9.0;8.0"}


def test_text_report_says_where_things_come_from(tmp_path):
    result = run_env(JITK_CUDA_ARCH="9.0", JITK_CACHE_DIR=str(tmp_path))
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(":", 1) for line in result.stdout.splitlines())
    assert lines["jitk"].strip() == jitk.__version__
    assert lines["builds for"].strip() == "sm_90 (JITK_CUDA_ARCH)"
    assert f"{toolchain.nvcc_path()} (" in lines["nvcc"]
    assert lines["cache"].strip() == f"{tmp_path}: 0 entries, 0.0 MiB"
    assert "JITK_CUDA_ARCH=9.0" in lines["settings"]


def test_missing_toolkit_and_gpu_are_reported_not_raised(monkeypatch, tmp_path):
    def no_nvcc():
        raise jitk.ToolchainError("jitk: could not find the CUDA toolkit")

    def no_nvrtc():
        raise nvrtc.NvrtcError("could not load libnvrtc.so.13")

    monkeypatch.setattr(toolchain, "find_nvcc", no_nvcc)
    monkeypatch.setattr(nvrtc, "version", no_nvrtc)
    monkeypatch.delenv("JITK_CUDA_ARCH", raising=False)
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(toolchain, "current_gpu_capability", lambda: None)
    report = env.collect()
    assert_stable_keys(report)
    assert report["nvcc"]["path"] is None
    assert "could not find the CUDA toolkit" in report["nvcc"]["error"]
    assert report["target_archs"]["archs"] is None
    assert "set JITK_CUDA_ARCH" in report["target_archs"]["error"]
    text = env.render(report)
    assert "nvcc:" in text and "error: jitk: could not find the CUDA toolkit" in text
    assert report["nvrtc"] == {"path": None, "version": None,
                               "error": "jitk: could not load libnvrtc.so.13",
                               "auto_builds_with": nvrtc.choose("auto")}
    assert "nvrtc:" in text and "not found: jitk: could not load libnvrtc.so.13" in text


def test_text_report_lists_every_declared_setting(tmp_path):
    """`python -m jitk env` prints every JITK_* setting with its value and meaning, a bad
    value as the error it gives, and a JITK_* name no setting declares."""
    from jitk.base import settings

    result = run_env(JITK_CUDA_ARCH="9.0", JITK_CACHE_DIR=str(tmp_path), JITK_AUTOTUNE="maybe",
                     JITK_REFERNCE="all")
    assert result.returncode == 0, result.stderr
    for name in settings.SETTINGS:
        assert f"  {name}: " in result.stdout, name
    assert "  JITK_AUTOTUNE: 'maybe' -> error: jitk: JITK_AUTOTUNE='maybe'" in result.stdout
    assert "  JITK_LOCK_TIMEOUT: unset -> default (300.0)" in result.stdout
    assert "  JITK_REFERNCE: not a jitk setting" in result.stdout
