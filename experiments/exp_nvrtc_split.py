"""Issue #38: the developer guide's axpy (fp32, sm_90) built cold the nvcc way (load_jit)
against the NVRTC split: device code by NVRTC in the process, the host half
(exp_nvrtc_axpy_host.cpp) by g++ alone, with and without a precompiled header of jitk's host
headers; then the two cubins' SASS side by side, and how far NVRTC gets through jitk's own
headers. Needs no GPU: nvcc, g++, the nvidia-cuda-nvrtc wheel, and for the SASS nvdisasm
(`pip download nvidia-cuda-nvdisasm`; give its path).

    PYTHONPATH=python python experiments/exp_nvrtc_split.py [--runs 3] [--nvdisasm PATH]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import tvm_ffi

from jitk.build import nvrtc, toolchain

REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "docs" / "developer_guide" / "example" / "axpy.cuh"
HOST = Path(__file__).resolve().parent / "exp_nvrtc_axpy_host.cpp"
INCLUDE = REPO / "python" / "jitk" / "include"
CUDA_INCLUDE = toolchain.cuda_home() / "include"
TVM_FFI_INCLUDE = Path(tvm_ffi.__file__).parent / "include"
HOST_FLAGS = ["-std=c++20", "-fPIC", f"-I{INCLUDE}", f"-I{TVM_FFI_INCLUDE}", f"-I{CUDA_INCLUDE}"]
PCH_HEADERS = "#include <jitk/export.h>\n#include <jitk/utils.cuh>\n"
EXPRESSION = "&axpy::axpy_kernel<float>"

# Each mode runs in a fresh process; it prints wall and CPU seconds (children included).
_NVCC = r"""
import resource, sys, time
import jitk
def cpu():
    own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
wall, used = time.perf_counter(), cpu()
jitk.load_jit("axpy", "fp32_t", cuda_files=[sys.argv[1]],
              cuda_wrappers=[("axpy", "axpy::Axpy<fp32_t>::run")])
print(time.perf_counter() - wall, cpu() - used)
"""
_SPLIT = r"""
import json, resource, subprocess, sys, time
import tvm_ffi
from jitk.build import nvrtc
source, out = sys.argv[1], sys.argv[2]
flags, link = json.loads(sys.argv[3]), json.loads(sys.argv[4])
nvrtc.version()  # the library loaded before the clock, as in a process that built before
def kids():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
wall, cpu = time.perf_counter(), time.process_time()
program = nvrtc.compile_cubin(source, "axpy.cu", [%(expression)r], %(options)r)
device_wall, device_cpu = time.perf_counter() - wall, time.process_time() - cpu
open(out + "/axpy.cubin", "wb").write(program.cubin)
host_wall, host_cpu = time.perf_counter(), kids()
subprocess.run(["g++", *flags, "-shared", "-Wl,-z,now", '-DEXP_CUBIN="%%s/axpy.cubin"' %% out,
                '-DEXP_LOWERED="%%s"' %% program.lowered[%(expression)r], %(host)r,
                "-o", out + "/axpy.so", *link], check=True)
host_wall, host_cpu = time.perf_counter() - host_wall, kids() - host_cpu
load = time.perf_counter()
tvm_ffi.load_module(out + "/axpy.so")
load = time.perf_counter() - load
print(device_wall, device_cpu, host_wall, host_cpu, load, time.perf_counter() - wall,
      device_cpu + host_cpu)
"""
NVRTC_OPTIONS = ["-arch=sm_90", "-std=c++20", f"-I{CUDA_INCLUDE}"]


def device_source() -> str:
    """The guide's kernel template, unchanged, cut out of axpy.cuh: its host half (jitk's
    headers, the launch wrapper) is what NVRTC cannot take (see probe_jitk_headers)."""
    text = GUIDE.read_text()
    body = text[text.index("#include <cuda_bf16.h>"):text.index("// The dtype is")]
    body = body.replace("using namespace jitk;", "")
    # NVRTC has no <cstdint>; nvcc (for the SASS comparison) takes the standard one.
    prologue = ("#ifdef __CUDACC_RTC__\ntypedef long long int64_t;\n"
                "#else\n#include <cstdint>\n#endif\n")
    return prologue + body + "}  // namespace axpy\n"


def child(code: str, *args: str, env: dict | None = None) -> list[float]:
    environment = {"PYTHONPATH": str(REPO / "python"), "JITK_CUDA_ARCH": "9.0", **(env or {})}
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                            timeout=900, env={**__import__("os").environ, **environment})
    if result.returncode:
        sys.exit(result.stderr[-3000:])
    return [float(value) for value in result.stdout.split()]


def compare_times(runs: int) -> None:
    link = toolchain.cudart_link_flags()
    split = _SPLIT % {"expression": EXPRESSION, "options": NVRTC_OPTIONS, "host": str(HOST)}
    pch_folders = {}
    for level in ("-O1", "-O0"):  # one precompiled header per level: gcc refuses a mismatch
        folder = Path(tempfile.mkdtemp())
        (folder / "jitk_host.h").write_text(PCH_HEADERS)
        subprocess.run(["g++", level, *HOST_FLAGS, "-x", "c++-header", str(folder / "jitk_host.h"),
                        "-o", str(folder / "jitk_host.h.gch")], check=True)
        pch_folders[level] = folder
    modes = {"host -O1": ["-O1"], "host -O1, PCH": ["-O1", "-include",
                                                     str(pch_folders["-O1"] / "jitk_host.h")],
             "host -O0, PCH": ["-O0", "-include", str(pch_folders["-O0"] / "jitk_host.h")]}
    rows: dict[str, list[list[float]]] = {}
    for _ in range(runs):  # interleaved, so that the machine's load falls on every mode
        with tempfile.TemporaryDirectory() as cache:
            rows.setdefault("nvcc, load_jit", []).append(
                child(_NVCC, str(GUIDE), env={"JITK_CACHE_DIR": cache}))
        for mode, flags in modes.items():
            with tempfile.TemporaryDirectory() as out:
                rows.setdefault(f"NVRTC + g++ {mode}", []).append(child(
                    split, device_source(), out, json.dumps(["-Winvalid-pch", *flags, *HOST_FLAGS]),
                    json.dumps(link)))
    print("nvcc columns: wall, CPU; split columns: device wall, device CPU, host wall, "
          "host CPU, dlopen, total wall, total CPU (seconds, medians)")
    for mode, values in rows.items():
        print(f"{mode}: {[round(statistics.median(c), 3) for c in zip(*values)]}  "
              f"runs {[[round(v, 3) for v in run] for run in values]}")
    for folder in pch_folders.values():
        shutil.rmtree(folder)


def compare_sass(nvdisasm: str, keep: Path | None) -> None:
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder, "axpy.cu")
        source.write_text(device_source() + "template __global__ void axpy::axpy_kernel<float>("
                          "float, const float*, float*, int64_t);\n")
        program = nvrtc.compile_cubin(source.read_text(), "axpy.cu", [EXPRESSION], NVRTC_OPTIONS)
        Path(folder, "nvrtc.cubin").write_bytes(program.cubin)
        subprocess.run([str(toolchain.find_nvcc()[0]), "-std=c++20", "-cubin", "-arch=sm_90",
                        str(source), "-o", str(Path(folder, "nvcc.cubin"))], check=True)
        listings = []
        for name in ("nvrtc", "nvcc"):
            text = subprocess.run([nvdisasm, "-c", str(Path(folder, f"{name}.cubin"))],
                                  capture_output=True, text=True, check=True).stdout
            # int64_t is long long under NVRTC and long under nvcc: only the mangling differs
            text = re.sub(r"PS1_[lx]", "PS1_", text)
            listings.append([line.split("*/", 1)[1].strip() for line in text.splitlines()
                             if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)])
        same = listings[0] == listings[1]
        print(f"SASS, sm_90: {len(listings[0])} vs {len(listings[1])} instructions, "
              f"{'identical' if same else 'DIFFERENT'}; lowered name {program.lowered}")
        if keep:  # for exp_nvrtc_launch.cpp on a GPU machine
            keep.mkdir(parents=True, exist_ok=True)
            for name in ("nvrtc.cubin", "nvcc.cubin"):
                shutil.copy(Path(folder, name), keep)


def probe_jitk_headers() -> None:
    """How far NVRTC gets through the guide's whole file (jitk's headers included)."""
    gcc = ["/usr/include/c++/12", "/usr/include/x86_64-linux-gnu/c++/12", "/usr/include"]
    tries = {"NVRTC's own headers": [],
             "with libstdc++ on the path": [f"-I{path}" for path in gcc],
             "with libstdc++ and -default-device": [*(f"-I{path}" for path in gcc),
                                                    "-default-device"]}
    for name, extra in tries.items():
        try:
            nvrtc.compile_cubin(f'#include "{GUIDE}"\n', "guide.cu", [EXPRESSION],
                                [*NVRTC_OPTIONS, f"-I{INCLUDE}", *extra])
            print(f"jitk headers, {name}: compiled")
        except nvrtc.NvrtcError as error:
            first = next(line for line in str(error).splitlines()
                         if "error" in line and "(" in line)
            print(f"jitk headers, {name}: {first.strip()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--nvdisasm", help="nvdisasm's path, for the SASS comparison")
    parser.add_argument("--keep", type=Path, help="a folder to keep the two cubins in")
    arguments = parser.parse_args()
    print(f"NVRTC {nvrtc.version()} from {nvrtc.library_path()}")
    probe_jitk_headers()
    if arguments.nvdisasm:
        compare_sass(arguments.nvdisasm, arguments.keep)
    compare_times(arguments.runs)


if __name__ == "__main__":
    main()
