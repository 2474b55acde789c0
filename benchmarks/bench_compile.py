"""Build time of every shipped kernel family's first precompile configuration, of the
developer guide's kernel (docs/developer_guide/example/axpy.cuh) and, on a GPU, of each
shipped op's real first call (OPS: the call as a user makes it, the shipped tuning table in
effect, on tensors made and CUDA started before the clock; timed to the end of the GPU's work).

Per module: the cold build (empty cache, a new process), the warm first load (the entry
cached, a new process) and the build's phases: nvcc's (`nvcc -time`, for the same command line
that the build ran), or for a file written in two halves built with NVRTC (--compiler, as
JITK_CUDA_COMPILER) its builds' own phases as their jit events give them (jitk.jit_stats():
the host half's compile and link, NVRTC's share, the copy into the cache). A host half reads the
precompiled prelude (jitk/build/pch.py), built before the timed runs unless --prelude fresh.
Runs without a GPU: the builds target JITK_CUDA_ARCH (default 9.0), and the warm figure is
the load only, no kernel call. "again" is the same call made once more in the warm process:
the call's own work, which its warm figure includes.

    python benchmarks/bench_compile.py [--runs 3] [--arch 9.0] [--only norm,axpy,rmsnorm]
                                       [--compiler auto|nvcc|nvrtc] [--prelude ready|fresh]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "docs" / "developer_guide" / "example"
FAMILIES = ("green", "hicache", "norm", "wait_value")
# Each op's first call (a GPU's): 16 x 4096 bf16 norms; HiCache one layer of 4096 tokens of
# 1 KiB, indices on the GPU (the kernel) and on the host (the copy engines); both stream ops.
OPS = ("rmsnorm", "fused_add_rmsnorm", "hicache_kernel", "hicache_copy_engine",
       "stream_values")
# A kernel author's loop: a copy of the guide's kernel, and of RMSNorm's files (4096 bf16, its
# two entry points), built, then built again after a comment is added to a file it includes;
# "cold" is the second build (no warm figure: each process has a copy of its own). The rebuild
# starts NVRTC beside the host compiler on the kernels the first build launched
# (jitk/build/device_halves.py); "_no_guess" is the same rebuild without that.
EDITS = ("edit_axpy", "edit_norm", "edit_norm_no_guess")
CHILD_TIMEOUT = 900  # seconds: one cold build on a loaded two-core machine stays well below

# Run in a child process: times the module's first load, then (asked for) rewrites the
# build it ran into a fresh folder and prints the compiler's command lines, read from ninja.
_CHILD = r"""
import json, subprocess, sys, tempfile, time
from pathlib import Path
target, want_commands = sys.argv[1], sys.argv[2] == "1"
import jitk
import jitk.build.jit as jit
from jitk.build import builder, toolchain
specs = []
original = jit.build_and_publish
jit.build_and_publish = lambda spec: specs.append(spec) or original(spec)
if target == "axpy":
    sys.path.insert(0, sys.argv[3])
    import torch, axpy
    thunk = lambda: axpy._axpy(torch.float32)
elif target.startswith("edit_"):  # a copy built, then edited: the rebuild is timed
    import shutil
    import jitk.kernels.norm
    copy = Path(tempfile.mkdtemp(prefix="bench_compile_edit_"))
    if target == "edit_axpy":
        shutil.copy(Path(sys.argv[3]) / "axpy.cuh", copy)
        kernel = edited = copy / "axpy.cuh"
        wrappers = [("axpy", "axpy::Axpy<fp32_t>::run")]
        name = ("axpy", "fp32_t")
    else:
        for header in Path(jitk.kernels.norm.__file__).parent.glob("*.cuh"):
            shutil.copy(header, copy)
        kernel, edited = copy / "rmsnorm.cuh", copy / "rmsnorm_kernels.cuh"
        wrappers = [("rmsnorm", "jitk::norm::RMSNorm<4096, bf16_t>::run"),
                    ("fused_add_rmsnorm", "jitk::norm::RMSNorm<4096, bf16_t>::run_fused_add")]
        name = ("rmsnorm", 4096, "bf16_t")
    thunk = lambda: jitk.load_jit(*name, cuda_files=[kernel], cuda_wrappers=wrappers,
                                  cuda_compiler="auto")
    thunk()
    if target.endswith("_no_guess"):  # the same-run baseline: NVRTC after the host compiler
        from jitk.build import device_halves
        device_halves.EARLY_MIN_CPUS = 1 << 30
    edited.write_text(edited.read_text() + "// an edit\n")
elif target in sys.argv[4].split(","):  # an op's first call, on tensors made before
    import torch, jitk
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    w, residual, out = torch.randn_like(x[0]), torch.randn_like(x), torch.empty_like(x)
    on = "cuda" if target == "hicache_kernel" else "cpu"
    host = torch.zeros(8192, 512, dtype=torch.bfloat16, pin_memory=True)
    device = torch.zeros(8192, 512, dtype=torch.bfloat16, device="cuda")
    tokens = torch.randperm(4096, device=on)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    calls = {
        "rmsnorm": lambda: jitk.rmsnorm(x, w, out, eps=1e-6),
        "fused_add_rmsnorm": lambda: jitk.fused_add_rmsnorm(x, residual, w, 1e-6),
        "stream_values": lambda: (jitk.stream_write_value(flag, 1),
                                  jitk.stream_wait_value(flag, 1)),
    }
    method = target.removeprefix("hicache_")
    one_layer = lambda: jitk.transfer_hicache_one_layer(device, device, tokens, host, host,
                                                         tokens, method=method)
    call = calls.get(target, one_layer)
    thunk = lambda: (call(), torch.cuda.synchronize())
else:
    import importlib
    thunk = importlib.import_module(f"jitk.kernels.{target}").precompile_configs()[0][1]
jitk.jit_stats(reset=True)
started = time.perf_counter()
thunk()
seconds = time.perf_counter() - started
phases = {}  # each build's phases (its jit event's), summed
for event in jitk.jit_stats()["events"]:
    for name, phase_seconds in event["phases"].items():
        phases[name] = phases.get(name, 0.0) + phase_seconds
import threading  # a host prelude begun beside this build, finished for the next (untimed)
for thread in [t for t in threading.enumerate() if t.name == "jitk-prelude"]:
    thread.join(600)
started = time.perf_counter()  # the same call again: its own work, with nothing to load
thunk()
again = time.perf_counter() - started
if target.startswith("edit_"):
    shutil.rmtree(copy)
commands = {}
if want_commands and specs:
    folder = Path(tempfile.mkdtemp(prefix="bench_compile_"))
    spec = specs[0]
    for name, text in spec.sources.items():
        (folder / name).write_text(text)
    (folder / "build.ninja").write_text(builder.build_file(spec))
    for obj in ("cuda.o", "main.o"):
        if any(name.startswith(obj[:-2] + ".") for name in spec.sources):
            done = subprocess.run([toolchain.ninja(), "-t", "commands", obj], cwd=folder,
                                  capture_output=True, text=True, check=True, timeout=60)
            commands[obj] = done.stdout.strip().splitlines()[-1]
    commands["folder"] = str(folder)
print("JSON" + json.dumps({"seconds": seconds, "again": again, "built": jit.build_count(),
                           "commands": commands, "phases": phases}))
"""


def child(target: str, env: dict, commands: bool) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, target, "1" if commands else "0",
                           str(GUIDE), ",".join(OPS)], env=env, capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("JSON")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{target}: the child failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][4:])


def nvcc_phases(command: str, folder: str) -> dict[str, float]:
    """Milliseconds per nvcc phase for `command` run again in `folder` (nvcc -time's CSV)."""
    with tempfile.NamedTemporaryFile(suffix=".csv") as table:
        words = shlex.split(command)
        subprocess.run([*words, "-time", table.name], cwd=folder, check=True,
                       capture_output=True, timeout=CHILD_TIMEOUT)
        phases: dict[str, float] = {}
        with open(table.name) as rows:
            for row in csv.reader(rows):
                if len(row) >= 8 and row[-1].strip() == "ms":
                    phase = row[1].strip()
                    phases[phase] = phases.get(phase, 0.0) + float(row[-2])
        return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--arch", default="9.0", help="JITK_CUDA_ARCH for the builds")
    parser.add_argument("--only", default="", help="comma-separated: families and/or axpy")
    parser.add_argument("--compiler", default="auto", choices=("auto", "nvcc", "nvrtc"),
                        help="JITK_CUDA_COMPILER: what builds files written in two halves")
    parser.add_argument("--prelude", default="ready", choices=("ready", "fresh"),
                        help="ready: the host halves' precompiled prelude is built before the "
                        "timed builds, as for every build but a machine's first; fresh: "
                        "each cold build starts without it (it is then built beside it)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    targets = [*FAMILIES, "axpy", *EDITS, *OPS]
    if args.only:
        unknown = set(args.only.split(",")) - set(targets)
        if unknown:
            parser.error(f"--only: unknown {', '.join(sorted(unknown))}; known: {targets}")
        targets = [t for t in targets if t in args.only.split(",")]
    if not torch.cuda.is_available() and set(OPS) & set(targets):
        print(f"skipped, as there is no GPU: {', '.join(t for t in targets if t in OPS)}")
        targets = [t for t in targets if t not in OPS]
    env = {**os.environ, "JITK_CUDA_ARCH": args.arch, "JITK_CUDA_COMPILER": args.compiler,
           "JITK_HOST_PRELUDE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "python"),
                                          os.environ.get("PYTHONPATH", "")])}
    print(f"{'module or call':<20}{'cold build s':>14}{'warm load s':>13}{'again s':>9}"
          "  phases (ms)")
    preludes = Path(tempfile.mkdtemp(prefix="bench_compile_prelude_"))
    for target in targets:
        cold, warm, again, commands, split = [], [], [], {}, []
        if args.prelude == "ready":  # an untimed build that leaves the prelude built
            with tempfile.TemporaryDirectory(prefix="bench_compile_cache_") as root:
                (Path(root) / ".pch").symlink_to(preludes)
                child(target, {**env, "JITK_CACHE_DIR": root}, commands=False)
        for run in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="bench_compile_cache_") as root:
                if args.prelude == "ready":
                    (Path(root) / ".pch").symlink_to(preludes)
                run_env = {**env, "JITK_CACHE_DIR": root}
                built = child(target, run_env, commands=run == 0)
                cold.append(built["seconds"])
                if "nvrtc" in built["phases"]:
                    split.append({name: 1000 * s for name, s in built["phases"].items()})
                if target not in EDITS:
                    found = child(target, run_env, commands=False)
                    warm.append(found["seconds"])
                    again.append(found["again"])
                commands = commands or built["commands"]
        phases = split
        if "folder" in commands:  # made by the child for this script: removed here
            if "cuda.o" in commands:
                phases = [nvcc_phases(commands["cuda.o"], commands["folder"])
                          for _ in range(args.runs)]
            shutil.rmtree(commands["folder"])
        names = list(phases[0]) if phases else []
        shown = ", ".join(f"{n} {statistics.median(p.get(n, 0.0) for p in phases):.0f}"
                          for n in names)
        warm_shown = (f"{statistics.median(warm):>13.3f}{statistics.median(again):>9.3f}"
                      if warm else f"{'-':>13}{'-':>9}")
        print(f"{target:<20}{statistics.median(cold):>14.2f}{warm_shown}  {shown}", flush=True)
    shutil.rmtree(preludes)


if __name__ == "__main__":
    main()
