"""NVRTC begun beside the host compiler (jitk/build/device_halves.py): a build whose module has
another entry in the cache (its kernel file edited since) compiles the kernels that entry
launched while the host half compiles, and uses those programs only where the host half
launches exactly those kernels. A wrong guess, one NVRTC refuses and one that someone else
could have written all end in the same entry as a build without a guess."""

from pathlib import Path

import pytest
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
    planted = plant_guess(tmp_path / "cache", ["&axpy::no_such_kernel<float>"], 0o644)
    load(kernel_file(tmp_path / "src"))
    assert [when for when, _ in compiles] == ["early", "after"]
    assert len(entries(tmp_path / "cache")) == 2  # the build's, and the planted folder
    assert sorted(p.name for p in planted.iterdir()) == [f"{MODULE}.kernels"]


def test_a_guess_someone_else_could_have_written_is_not_read(compiles, tmp_path):
    plant_guess(tmp_path / "cache", ["&axpy::axpy_kernel<float>"], 0o666)
    load(kernel_file(tmp_path / "src"))
    assert [when for when, _ in compiles] == ["after"]
