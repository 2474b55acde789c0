"""load_jit(..., host_units=N): a host half's wrappers dealt out over up to N translation units
(one an idle CPU at most), compiled side by side. The entry's key is the one unit's, so a machine
with more CPUs finds the entry that one with fewer built; every export works from whichever
unit holds it; the shipped modules that ask for units (HiCache's, RMSNorm's) keep one copy of
each static."""

import collections
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from child_env import PYTHON_PATH
from errors import expect_error
from needs_nvrtc import NEEDS_NVRTC

import jitk
from jitk.base.errors import JitkError
from jitk.build import cpus, device_halves, jit
from jitk.kernels import norm
from jitk.kernels.hicache import modules

KERNEL = Path(__file__).resolve().parents[1] / "docs" / "developer_guide" / "example" / "axpy.cuh"
WRAPPERS = [("axpy_f32", "axpy::Axpy<fp32_t>::run"), ("axpy_bf16", "axpy::Axpy<bf16_t>::run"),
            ("axpy_f16", "axpy::Axpy<fp16_t>::run")]

pytestmark = NEEDS_NVRTC


def load(**changes):
    return jitk.load_jit("units_axpy", cuda_files=[KERNEL], cuda_wrappers=WRAPPERS,
                         cuda_compiler="nvrtc", **changes)


def the_entry(cache: Path) -> Path:
    (entry,) = [p for p in cache.iterdir() if p.is_dir() and p.name.startswith("units_axpy")]
    return entry


def units_of(entry: Path) -> dict[str, list[str]]:
    """host half unit -> the exports it defines."""
    return {unit.name: [line.split("(")[1].split(",")[0] for line in unit.read_text().splitlines()
                        if line.startswith("JITK_EXPORT(")]
            for unit in sorted(entry.glob("host_half*.cpp"))}


def test_wrappers_are_dealt_out_and_each_export_works(tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jit, "spare_cpus", lambda: 8)
    module = load(host_units=2)
    assert units_of(the_entry(tmp_path)) == {"host_half.cpp": ["axpy_f32", "axpy_f16"],
                                             "host_half_1.cpp": ["axpy_bf16"]}
    x = torch.ones(8)  # on the CPU: each unit's checks run and name the tensor and the file
    for export in ("axpy_f32", "axpy_bf16", "axpy_f16"):
        expect_error(lambda export=export: getattr(module, export)(1.0, x, x), "'x'",
                     "axpy.cuh:")
    kernels = next(the_entry(tmp_path).glob("*.kernels")).read_text().splitlines()
    assert len(kernels) == 3  # the kernels each unit launches, all listed


def test_the_key_is_the_one_units_and_cpus_bound_the_units(tmp_path, monkeypatch):
    """Two idle CPUs, four units asked: two. One: one unit, and the same entry folder as the
    build in two units, so that machines of any size and load share entries."""
    monkeypatch.setattr(jit, "spare_cpus", lambda: 2)
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "two"))
    load(host_units=4)
    two = the_entry(tmp_path / "two")
    assert list(units_of(two)) == ["host_half.cpp", "host_half_1.cpp"]
    monkeypatch.setattr(jit, "spare_cpus", lambda: 1)
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "one"))
    load(host_units=4)
    one = the_entry(tmp_path / "one")
    assert list(units_of(one)) == ["host_half.cpp"]
    assert one.name == two.name
    monkeypatch.setattr(jit, "spare_cpus", lambda: 8)
    built = jitk.jit_stats()["build"]["count"]
    load(host_units=3)  # found, not built again, with more CPUs
    assert jitk.jit_stats()["build"]["count"] == built
    assert list(units_of(one)) == ["host_half.cpp"]


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2", None])
def test_host_units_is_checked_before_any_build(tmp_path, monkeypatch, bad):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    expect_error(lambda: load(host_units=bad), "host_units", "expected an int of at least 1",
                 repr(bad), kind=JitkError)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("which", ["hicache copy", "hicache staged", "hicache kernel", "norm"])
def test_shipped_modules_in_units_keep_one_copy_of_each_static(tmp_path, monkeypatch, which):
    """Each unit reads the family's headers: a namespace-scope static among them would be one
    a unit, its state split. In the linked library each data symbol is there once."""
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jit, "spare_cpus", lambda: 8)
    {"hicache copy": modules.copy_module.__wrapped__,
     "hicache staged": modules.staged_module.__wrapped__,
     "hicache kernel": lambda: modules.kernel_module.__wrapped__(1024, 4),
     "norm": dict(norm.precompile_configs())["hidden=4096 bfloat16"]}[which]()
    (entry,) = [p for p in tmp_path.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(units_of(entry)) > 1
    symbols = subprocess.run(["nm", "--defined-only", str(next(entry.glob("*.so")))],
                             capture_output=True, text=True, check=True, timeout=60).stdout
    data = [line.split()[-1] for line in symbols.splitlines()
            if line.split()[-2].lower() in ("b", "d", "u", "v")]
    assert data, symbols[:2000]
    twice = [name for name, count in collections.Counter(data).items() if count > 1]
    assert not twice, twice


def test_spare_cpus_are_the_share_less_the_load(monkeypatch):
    """A process's builds take the CPUs less the load, and of them only the process's share
    where it is one of several building side by side (precompile's workers)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    for load, spare in ((0.2, 16), (3.6, 12), (15.7, 1), (40.0, 1)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        assert cpus.spare_cpus() == spare, load

    def no_load_average():
        raise OSError("no load average")
    monkeypatch.setattr(os, "getloadavg", no_load_average)
    assert cpus.spare_cpus() == 16
    try:
        for workers, spare in ((4, 4), (16, 1), (40, 1)):
            cpus.share_cpus(workers)
            assert cpus.spare_cpus() == spare, workers
    finally:
        cpus.share_cpus(1)
    assert cpus.spare_cpus() == 16


def test_nvrtc_parts_take_the_spare_cpus(monkeypatch):
    """A module's NVRTC programs are as many as its kernels, the spare CPUs and the cap allow:
    a precompile worker of 16 on 16 CPUs builds its kernels in one program, not the cap's."""
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    cap = device_halves.MAX_NVRTC_PARTS
    assert cap >= 2 and device_halves.nvrtc_parts(1) == 1
    assert device_halves.nvrtc_parts(100) == cap
    try:
        cpus.share_cpus(16 // cap)
        assert device_halves.nvrtc_parts(100) == cap
        cpus.share_cpus(16)
        assert device_halves.nvrtc_parts(100) == 1
    finally:
        cpus.share_cpus(1)


WORKER_UNITS = """
import sys
from jitk.build import cpus
from jitk.tools import precompile
precompile.init_worker("", int(sys.argv[1]))
print(cpus.spare_cpus())
"""


def test_a_precompile_worker_takes_its_share(tmp_path):
    """precompile's workers (and the tuner's) start knowing how many build beside them."""
    cpus = os.cpu_count() or 1
    done = subprocess.run([sys.executable, "-c", WORKER_UNITS, str(cpus)], capture_output=True,
                          text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": PYTHON_PATH,
                               "JITK_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0 and done.stdout.split()[-1] == "1", done.stderr[-2000:]
