"""NVRTC begun beside the host compiler (jitk/build/device_halves.py): a build whose module has
another entry in the cache (its kernel file edited since) compiles the kernels that entry
launched while the host half compiles, and uses those programs only where the host half
launches exactly those kernels. A wrong guess, one NVRTC refuses and one that someone else
could have written all end in the same entry as a build without a guess."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from child_env import PYTHON_PATH
from needs_nvrtc import NEEDS_NVRTC

import jitk
from jitk.build import device_halves

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "developer_guide" / "example" / "axpy.cuh"
F32 = ("axpy_f32", "axpy::Axpy<fp32_t>::run")
BF16 = ("axpy_bf16", "axpy::Axpy<bf16_t>::run")
MODULE = "early_axpy_fp32_t_bf16_t"

pytestmark = NEEDS_NVRTC


@pytest.fixture
def compiles(monkeypatch, tmp_path):
    """Every NVRTC compile of a build, as "early" (beside the host compiler) or "after" (once
    the host half named its kernels), with a guess taken whatever the CPUs."""
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("JITK_CUDA_ARCH", "9.0")
    monkeypatch.setattr(device_halves, "EARLY_MIN_CPUS", 1)
    seen = []
    original = device_halves._compile

    def spied(spec, options, expressions, folder):
        seen.append(("early" if folder is None else "after", list(expressions)))
        return original(spec, options, expressions, folder)
    monkeypatch.setattr(device_halves, "_compile", spied)
    return seen


def kernel_file(folder: Path, comment: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "axpy.cuh"
    path.write_text(GUIDE.read_text() + comment)
    return path


def load(kernel: Path, wrappers=(F32, BF16)):
    return jitk.load_jit("early_axpy", "fp32_t", "bf16_t", cuda_files=[kernel],
                         cuda_wrappers=list(wrappers), cuda_compiler="nvrtc")


def entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if p.is_dir() and p.name.startswith(MODULE))


def device_code(entry: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in entry.iterdir()
            if p.suffix in (".cubin", ".ptx", ".kernels")}


def test_an_edited_kernel_file_takes_the_programs_compiled_beside_the_host_half(
        compiles, tmp_path, monkeypatch):
    load(kernel_file(tmp_path / "src"))
    assert [when for when, _ in compiles] == ["after"]  # nothing to guess from
    [first] = entries(tmp_path / "cache")
    compiles.clear()
    load(kernel_file(tmp_path / "src", "// an edit\n"))
    assert [when for when, _ in compiles] == ["early"]
    [edited] = [e for e in entries(tmp_path / "cache") if e != first]
    # the same device code as a build of the edited file with no guess to take
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "alone"))
    compiles.clear()
    load(kernel_file(tmp_path / "src", "// an edit\n"))
    assert [when for when, _ in compiles] == ["after"]
    [alone] = entries(tmp_path / "alone")
    assert device_code(edited) == device_code(alone) != {}


def test_a_header_edit_takes_the_kernels_of_the_entry_it_makes_stale(compiles, tmp_path):
    kernel = kernel_file(tmp_path / "src")
    kernel.write_text('#include "extra.h"\n' + kernel.read_text())
    (tmp_path / "src" / "extra.h").write_text("// a header the kernel file reads\n")
    load(kernel)
    [entry] = entries(tmp_path / "cache")
    before = device_code(entry)
    compiles.clear()
    (tmp_path / "src" / "extra.h").write_text("// a header the kernel file reads, edited\n")
    load(kernel)  # the same key: the entry is built again, its kernels the guess
    assert [when for when, _ in compiles] == ["early"]
    assert entries(tmp_path / "cache") == [entry] and device_code(entry) == before


def test_a_wrong_guess_is_compiled_again_for_the_kernels_launched(compiles, tmp_path):
    load(kernel_file(tmp_path / "src"), wrappers=[F32])
    compiles.clear()
    module = load(kernel_file(tmp_path / "src"))  # another key: bf16 is launched too
    [(when, guess), (again, launched)] = compiles
    assert (when, again) == ("early", "after") and len(guess) == 1 and len(launched) == 2
    listed = [sorted(line.split("\t")[0] for line in (e / f"{MODULE}.kernels").read_text()
                     .splitlines()) for e in entries(tmp_path / "cache")]
    assert sorted(listed) == sorted([guess, sorted(launched)])
    assert module.axpy_bf16 is not None


def plant_guess(cache: Path, expressions: list[str], mode: int) -> Path:
    """Another's folder named like an entry of the module, with a kernels list and no record."""
    folder = cache / f"{MODULE}_{'0' * 16}_sm90"
    folder.mkdir(parents=True)
    kernels = folder / f"{MODULE}.kernels"
    kernels.write_text("".join(f"{e}\t_Z1xv\t0\n" for e in expressions))
    kernels.chmod(mode)
    return folder


def test_a_guess_nvrtc_refuses_is_compiled_again_and_the_planted_folder_stays(
        compiles, tmp_path):
    cache = tmp_path / "cache"
    planted = plant_guess(cache, ["&axpy::no_such_kernel<float>"], 0o644)
    (cache / "my notes").mkdir()  # a user's folder and foreign locks where the build runs
    (cache / "my notes" / "keep.txt").write_text("mine")
    foreign_locks = [cache / f"{MODULE}_{'1' * 16}_sm90.lock", cache / "someone.lock"]
    for lock in foreign_locks:
        lock.write_text("held elsewhere")
    load(kernel_file(tmp_path / "src"))
    assert [when for when, _ in compiles] == ["early", "after"]
    assert len(entries(cache)) == 2  # the build's, and the planted folder
    assert sorted(p.name for p in planted.iterdir()) == [f"{MODULE}.kernels"]
    assert (cache / "my notes" / "keep.txt").read_text() == "mine"
    assert all(lock.read_text() == "held elsewhere" for lock in foreign_locks)


def test_a_guess_someone_else_could_have_written_is_not_read(compiles, tmp_path):
    plant_guess(tmp_path / "cache", ["&axpy::axpy_kernel<float>"], 0o666)
    load(kernel_file(tmp_path / "src"))
    assert [when for when, _ in compiles] == ["after"]


# A build in a child process whose NVRTC compiles never return (all of them, or the early
# one's only: those given no folder): after a first build that leaves the module an entry,
# the kernel file is edited and built again under a short JITK_LOCK_TIMEOUT.
HUNG = """
import os, sys, time
from pathlib import Path
import jitk
from jitk.build import device_halves, nvrtc
kernel, which = Path(sys.argv[1]), sys.argv[2]
load = lambda: jitk.load_jit("hung_axpy", "fp32_t", cuda_files=[kernel], cuda_compiler="nvrtc",
                             cuda_wrappers=[("axpy_f32", "axpy::Axpy<fp32_t>::run")])
load()
real = nvrtc.compile_cubin
def hung(*args):
    if which == "all" or args[5] is None:
        time.sleep(3600)
    return real(*args)
nvrtc.compile_cubin = hung
device_halves.EARLY_MIN_CPUS = 1 if which == "early" else 1 << 30
kernel.write_text(kernel.read_text() + "// an edit\\n")
os.environ["JITK_LOCK_TIMEOUT"] = "8"
try:
    load()
    print("built")
except jitk.JitCompileError as error:
    print("refused:", str(error).splitlines()[1])
"""


def hung_build(tmp_path, which: str) -> tuple[str, float]:
    env = {**os.environ, "JITK_CACHE_DIR": str(tmp_path / "cache"), "JITK_CUDA_ARCH": "9.0",
           "PYTHONPATH": PYTHON_PATH}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", HUNG, str(kernel_file(tmp_path / "src")),
                           which], env=env, capture_output=True, text=True, timeout=240,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1], time.monotonic() - started


def test_nvrtc_that_never_returns_fails_the_build_and_the_process_still_exits(tmp_path):
    """Its wait is JITK_LOCK_TIMEOUT's, and the error names what it waited for; the compiles
    left running do not hold the process's exit (the old pool's threads did)."""
    line, _ = hung_build(tmp_path, "all")
    assert line == ("refused: jitk: NVRTC did not finish compiling the kernels of hung_axpy_fp32_t "
                    "within 8 s (JITK_LOCK_TIMEOUT)")


def test_an_early_compile_that_never_returns_is_compiled_again(tmp_path):
    line, seconds = hung_build(tmp_path, "early")
    assert line == "built"
    assert seconds < 200  # waited for the early compile no longer than the timeout
