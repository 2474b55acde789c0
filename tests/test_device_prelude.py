"""What NVRTC reads and what it reads first: a device half loads the device prelude that
NVRTC precompiled in the process (jitk/build/device_prelude.py) and makes the same code as
one that parses it; the headers NVRTC read, those only the device half includes among them,
are in the entry's record, so an edit of one rebuilds the entry; the process removes its
preludes' folder when it exits (a forked child leaves it); a process that ends before the
host prelude it began is built finishes it first; a build waits for a device prelude no longer
than it is told; and the host prelude has builds link with gold only where its build found
that gold links with the compiler."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from child_env import PYTHON_PATH
from needs_nvrtc import NEEDS_NVRTC

import jitk
from jitk.build import jit, nvrtc, pch, toolchain
from jitk.build.builder import host_half_flags

pytestmark = NEEDS_NVRTC

# A kernel in two halves whose device half alone includes a header (scale.cuh).
KERNEL = """#include <jitk/nvrtc.cuh>
#include <jitk/utils.cuh>
#if JITK_DEVICE_HALF
#include "scale.cuh"
#endif
#if JITK_HOST_HALF
#include <jitk/tensor.h>
#endif
namespace scaled {
template <typename T>
__global__ void scale_kernel(T* x, int64_t n)
#if JITK_DEVICE_HALF
{
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < n) x[i] = x[i] * T(kScale);
}
#else
    ;
#endif
#if JITK_HOST_HALF
using namespace jitk;
template <typename T>
struct Scale {
  static void run(TensorView x) {
    SymbolicSize n{"length"};
    SymbolicDevice device;
    TensorMatcher({n}).with_device<kDLCUDA>(device).with_dtype<T>().verify(x, "x");
    LaunchKernel(div_ceil(n.unwrap(), 128), 128, device.unwrap())
        .launch<scale_kernel<T>>(static_cast<T*>(x.data_ptr()), n.unwrap());
  }
};
#endif
}  // namespace scaled
"""


def write_kernel(folder: Path, scale: str = "2.0f") -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "scale.cuh").write_text(f"#pragma once\nconstexpr float kScale = {scale};\n")
    path = folder / "scaled.cuh"
    path.write_text(KERNEL)
    return path


def load_scaled(kernel: Path, *name: str):
    return jitk.load_jit("scaled", *name, cuda_files=[kernel], cuda_compiler="nvrtc",
                         cuda_wrappers=[("scale", "scaled::Scale<fp32_t>::run")])


def _spy(monkeypatch) -> list[tuple[object, nvrtc.Program]]:
    """Every NVRTC compile of a build: the precompiled header it was given, and its result."""
    compiled, compile_cubin = [], nvrtc.compile_cubin

    def spy(*args, **kwargs):
        program = compile_cubin(*args, **kwargs)
        compiled.append((args[4] if len(args) > 4 else kwargs.get("pch"), program))
        return program
    monkeypatch.setattr(nvrtc, "compile_cubin", spy)
    return compiled


def test_a_device_half_loads_the_prelude_and_makes_the_same_code(tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "cache"))
    kernel = write_kernel(tmp_path / "src")
    compiled = _spy(monkeypatch)
    load_scaled(kernel, "fp32_t")  # the first build of the process waits for the prelude it began
    monkeypatch.setenv("JITK_DEVICE_PRELUDE", "0")
    load_scaled(kernel, "fp32_t", "parsed")
    (given, loaded), (none, parsed) = compiled
    assert given is not None and given.is_file() and loaded.used_pch
    assert none is None and not parsed.used_pch
    assert loaded.cubin == parsed.cubin and loaded.ptx == parsed.ptx
    assert "precompiled header" not in loaded.log  # NVRTC's note on it is not a warning


WITHOUT_A_TEMPORARY_FOLDER = r"""
import sys, tempfile
sys.path.insert(0, sys.argv[1])
tempfile.tempdir = sys.argv[2]  # a folder that is not there: nothing can be made in it
from pathlib import Path
from jitk.build import nvrtc
from test_device_prelude import load_scaled, write_kernel
compiled, compile_cubin = [], nvrtc.compile_cubin
nvrtc.compile_cubin = lambda *a, **k: compiled.append((a, k)) or compile_cubin(*a, **k)
load_scaled(write_kernel(Path(sys.argv[3])), "fp32_t")
print("pch given:", [args[4] for args, _ in compiled])
"""


def test_without_a_temporary_folder_builds_go_on_and_parse_the_prelude(tmp_path):
    """The device prelude lives in a temporary folder; NVRTC's trace goes to the build's."""
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_A_TEMPORARY_FOLDER, str(Path(__file__).parent),
         str(tmp_path / "missing"), str(tmp_path / "src")],
        env={**os.environ, "JITK_CACHE_DIR": str(tmp_path / "cache"),
             "JITK_STAGING_DIR": str(tmp_path / "staging"), "PYTHONPATH": PYTHON_PATH},
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[0] == "pch given: [None]", done.stdout
    assert not (tmp_path / "missing").exists()
    assert not list((tmp_path / "cache").glob("*/nvrtc-*"))  # each trace removed, not kept


def test_a_header_only_the_device_half_reads_is_recorded_and_an_edit_rebuilds(
        tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "cache"))
    kernel = write_kernel(tmp_path / "src")
    load_scaled(kernel, "fp32_t")
    (entry,) = [p for p in (tmp_path / "cache").iterdir()
                if p.is_dir() and p.name.startswith("scaled_")]
    headers = json.loads((entry / "jitk-meta.json").read_text())["headers"]
    assert str(tmp_path / "src" / "scale.cuh") in headers  # read by NVRTC alone
    # The prelude's headers too, though NVRTC loaded them precompiled.
    assert any(name.endswith("include/jitk/packed.cuh") for name in headers)
    before = jit.build_count()
    load_scaled(kernel, "fp32_t")
    assert jit.build_count() == before
    (tmp_path / "src" / "scale.cuh").write_text("#pragma once\nconstexpr float kScale = 3.0f;\n")
    load_scaled(kernel, "fp32_t")
    assert jit.build_count() == before + 1


FORKED_AND_EXITED = r"""
import os, sys, tempfile
sys.path.insert(0, sys.argv[1])
from test_device_prelude import write_kernel, load_scaled
from pathlib import Path
load_scaled(write_kernel(Path(sys.argv[2])), "fp32_t")
made = [p for p in os.listdir(tempfile.gettempdir()) if p.startswith("jitk-device-prelude-")]
print("made", len(made), flush=True)
child = os.fork()
if child == 0:
    sys.exit(0)  # a normal exit: atexit runs in the forked child too
os.waitpid(child, 0)
left = [p for p in os.listdir(tempfile.gettempdir()) if p.startswith("jitk-device-prelude-")]
print("after the fork", len(left), flush=True)
"""


# NVRTC's making of the prelude held until released, as a making that never ends would be.
STUCK_MAKING = """
import threading, time
from jitk.build import device_prelude, nvrtc
release = threading.Event()
nvrtc.create_pch = lambda *args: release.wait(120) and ()
started = time.perf_counter()
got = device_prelude.get(["-arch=sm_90", *nvrtc.OPTIONS], 0.5)
print(got, round(time.perf_counter() - started, 1), flush=True)
"""  # and exits, the making still held: the exit must not wait for it


def test_a_build_waits_for_the_device_prelude_no_longer_than_its_timeout_nor_its_exit(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", STUCK_MAKING],
        env={**os.environ, "JITK_CACHE_DIR": str(tmp_path), "PYTHONPATH": PYTHON_PATH},
        capture_output=True, text=True, timeout=60, check=False)  # the making holds 120 s
    assert done.returncode == 0, done.stderr[-2000:]
    got, waited = done.stdout.split()
    assert got == "None" and 0.4 <= float(waited) < 5, done.stdout


def test_the_process_removes_its_preludes_folder_and_a_fork_leaves_it(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", FORKED_AND_EXITED, str(Path(__file__).parent),
         str(tmp_path / "src")],
        env={**os.environ, "TMPDIR": str(temp), "JITK_CACHE_DIR": str(tmp_path / "cache"),
             "PYTHONPATH": PYTHON_PATH},
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["made 1", "after the fork 1"], done.stdout
    assert not any(p.name.startswith("jitk-device-prelude-") for p in temp.iterdir())


def test_what_jitk_did_not_make_survives_where_its_preludes_and_traces_are(tmp_path):
    """A user's folder (named like jitk's own) and a foreign lock, planted in the temporary
    folder (the device prelude's), the staging folder (NVRTC's traces) and .pch (the host
    prelude and its gold probe), outlive a process that made and removed its own there."""
    temp, staging, cache = tmp_path / "tmp", tmp_path / "staging", tmp_path / "cache"
    planted = []
    for folder in (temp, staging, cache / pch.FOLDER):
        users = folder / "jitk-device-prelude-users-own"
        users.mkdir(parents=True)
        (users / "notes.txt").write_text("mine")
        (folder / "nvrtc-mine.trace.json").write_text("{}")
        (folder / "foreign.lock").write_text("12345")
        planted += [users / "notes.txt", folder / "nvrtc-mine.trace.json", folder / "foreign.lock"]
    done = subprocess.run(
        [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
         "from test_device_prelude import write_kernel, load_scaled; from pathlib import Path; "
         "load_scaled(write_kernel(Path(sys.argv[2])), 'fp32_t')", str(Path(__file__).parent),
         str(tmp_path / "src")],
        env={**os.environ, "TMPDIR": str(temp), "JITK_STAGING_DIR": str(staging),
             "JITK_CACHE_DIR": str(cache), "JITK_HOST_PRELUDE": "1", "PYTHONPATH": PYTHON_PATH},
        capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert all(path.is_file() for path in planted), [p for p in planted if not p.is_file()]
    assert [p.name for p in temp.iterdir() if p.name.startswith("jitk-device-prelude-")] == [
        "jitk-device-prelude-users-own"]  # its own removed at exit, the user's kept


def test_a_process_that_ends_first_finishes_the_host_prelude_it_began(tmp_path):
    cache = tmp_path / "cache"
    done = subprocess.run(
        [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
         "from test_device_prelude import write_kernel, load_scaled; from pathlib import Path; "
         "load_scaled(write_kernel(Path(sys.argv[2])), 'fp32_t')", str(Path(__file__).parent),
         str(tmp_path / "src")],
        env={**os.environ, "JITK_CACHE_DIR": str(cache), "JITK_HOST_PRELUDE": "1",
             "PYTHONPATH": PYTHON_PATH},
        capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    built = [p.parent for p in (cache / pch.FOLDER).glob("*/prelude.h.gch")]
    assert len(built) == 1 and (built[0] / pch.RUNTIME).is_file()
    assert len(built[0].name) == 64  # renamed into place: not a private folder left behind


@pytest.mark.skipif(shutil.which("ld.gold") is None, reason="no ld.gold here")
def test_builds_link_with_gold_only_where_it_links_with_the_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_HOST_PRELUDE", "1")
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "cache"))
    flags = host_half_flags(("9.0",), [str(pch.INCLUDE)])
    built = pch.build(toolchain.host_compiler(), flags)
    # Whether gold links a C++ library with this compiler, asked apart from jitk.
    (tmp_path / "one.cpp").write_text("#include <string>\nstd::string one() { return \"1\"; }\n")
    probe = subprocess.run([toolchain.host_compiler(), "-shared", "-fPIC", "-fuse-ld=gold",
                            "one.cpp", "-o", "one.so"], cwd=tmp_path, capture_output=True,
                           timeout=120, check=False)
    assert built is not None
    assert ("-fuse-ld=gold" in built.link_inputs()) == (probe.returncode == 0), probe.stderr
    # A compiler whose libraries gold cannot open (GCC under /opt on the GPU machine's host).
    wrapper = tmp_path / "c++"
    wrapper.write_text(f"""#!/bin/sh
for word in "$@"; do [ "$word" = -fuse-ld=gold ] && {{ echo "gold: cannot open" >&2; exit 1; }}
done
exec {toolchain.host_compiler()} "$@"
""")
    wrapper.chmod(0o755)
    unlinked = pch.build(str(wrapper), flags)
    assert unlinked is not None and unlinked.folder != built.folder
    assert "-fuse-ld=gold" not in unlinked.link_inputs()
    assert not list(unlinked.folder.glob("*.so"))  # the probe's library is not left behind


def test_nvvms_threads_change_only_the_order_of_the_code():
    """-split-compile (nvrtc.OPTIONS) optimises kernels apart: the PTX holds the same lines."""
    include = pch.INCLUDE
    cuda = toolchain.cuda_home() / "include"
    guide = Path(__file__).resolve().parents[1] / "docs" / "developer_guide" / "example"
    options = ["-arch=sm_90", "-std=c++20", "-default-device",
               *(f"-I{p}" for p in (include / "nvrtc_std", include, cuda, cuda / "cccl"))]
    assert "-split-compile=0" in nvrtc.OPTIONS
    source = f'{nvrtc.PRELUDE}#include "{guide / "axpy.cuh"}"\n'
    names = ["&axpy::axpy_kernel<float>", "&axpy::axpy_kernel<__nv_bfloat16>"]

    def lines(extra: list[str]) -> list[str]:
        ptx = nvrtc.compile_cubin(source, "axpy.cu", names, [*options, *extra]).ptx.decode()
        return sorted(line for line in ptx.splitlines() if not line.startswith("//"))
    assert lines(["-split-compile=0"]) == lines([])
