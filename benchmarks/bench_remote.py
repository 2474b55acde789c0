"""A cold process's first call through the remote cache (an OCI registry on loopback)
against a local compile of the same entry, in the same run, per shipped kernel family; and
`python -m jitk cache pull` of every shipped configuration (with --quick: of what the
per-family rows pushed).

Per family, each in a new process with an empty cache: the first call compiles here (no
remote), its cache is pushed, then the first call again with the registry set and
JITK_DISABLE_JIT=1 (a fetch or a failure, never a build). With a GPU the first call is the
family's op on small tensors (green: its module's load); without one it is the load of the
family's first precompile configuration, built for JITK_CUDA_ARCH (default 9.0).

The registry is Debian's docker-registry, started by jitk.tools.local_registry: on PATH,
else unpacked (dpkg -x) from the .deb in .debs/ that the device carries
(scripts/gpu_remote_check.sh), on a free 127.0.0.1 port.

    python benchmarks/bench_remote.py [--quick] [--json PATH]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import parse_args, print_table, write_json

from jitk.tools import local_registry

REPO = Path(__file__).resolve().parent.parent
CHILD_SECONDS = 900  # one cold compile on a loaded machine stays well below
STEP_SECONDS = 1800  # precompile of every shipped configuration, a push or a pull
# The .deb the device carries (scripts/gpu_remote_check.sh), here or at the checkout's root.
DEB_DIRS = (REPO / ".debs", REPO.parent.parent / ".debs")
# family -> (what the GPU call is, the code that makes it); `first` is the CPU fallback.
GPU_CALLS = {
    "norm": ("rmsnorm 4x4096 bf16", """
x = torch.randn(4, 4096, dtype=torch.bfloat16, device="cuda")
jitk.rmsnorm(x, torch.ones(4096, dtype=torch.bfloat16, device="cuda"), torch.empty_like(x))
"""),
    "hicache": ("transfer_hicache_one_layer", """
k, v = (torch.zeros(16, 2, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
hk, hv = (torch.zeros(32, 2, 64, dtype=torch.bfloat16).pin_memory() for _ in range(2))
slots = torch.arange(8, device="cuda")
jitk.transfer_hicache_one_layer(k, v, slots, hk, hv, slots)
"""),
    "wait_value": ("stream_write_value", """
jitk.stream_write_value(torch.zeros(1, dtype=torch.int32, device="cuda"), 1)
"""),
}
FAMILIES = ("green", "hicache", "norm", "wait_value")
CHILD = """
import importlib, json, sys, time
import torch
import jitk
from jitk.build.jit import build_count
family, code = sys.argv[1], sys.argv[2]
first = importlib.import_module("jitk.kernels." + family).precompile_configs()[0][1]
started = time.perf_counter()
exec(code) if code else first()
if torch.cuda.is_available():
    torch.cuda.synchronize()
print(json.dumps({"seconds": time.perf_counter() - started, "builds": build_count()}))
"""


def run(folder: Path, arguments: list[str], timeout: float, **settings: str):
    """python `arguments` as a host whose cache and staging folders are in `folder`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JITK_")}
    env.update({"PYTHONPATH": os.pathsep.join([str(REPO / "python"),
                                               env.get("PYTHONPATH", "")]),
                "JITK_CACHE_DIR": str(folder / "cache"),
                "JITK_STAGING_DIR": str(folder / "staging"), **settings})
    if not torch.cuda.is_available():
        env["JITK_CUDA_ARCH"] = os.environ.get("JITK_CUDA_ARCH", "9.0")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, *arguments], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        sys.exit(f"bench_remote: {' '.join(arguments[:4])} failed:\n{done.stdout[-2000:]}"
                 f"\n{done.stderr[-4000:]}")
    return done.stdout, time.perf_counter() - started


def first_call(folder: Path, family: str, **settings: str) -> dict:
    code = GPU_CALLS[family][1] if family in GPU_CALLS and torch.cuda.is_available() else ""
    out, _ = run(folder, ["-c", CHILD, family, code], CHILD_SECONDS, **settings)
    return json.loads(out.splitlines()[-1])


def measure(work: Path, where: str, quick: bool) -> tuple[list[dict], str, float]:
    """The rows per family, and `cache pull`'s output and seconds, against `where`."""
    gpu = torch.cuda.is_available()
    push = {"JITK_REMOTE_CACHE": where,
            "JITK_REMOTE_CACHE_KEY": str(work / "keys" / "jitk-remote.key")}
    pull = {"JITK_REMOTE_CACHE": where,
            "JITK_REMOTE_CACHE_TRUST": str(work / "keys" / "jitk-remote.pub"),
            "JITK_DISABLE_JIT": "1"}
    rows = []
    for family in FAMILIES:
        local = first_call(work / f"{family}-local", family)
        run(work / f"{family}-local", ["-m", "jitk", "cache", "push"], STEP_SECONDS, **push)
        fetched = first_call(work / f"{family}-remote", family, **pull)
        what = GPU_CALLS[family][0] if gpu and family in GPU_CALLS else "module load"
        rows.append({"family": family, "first call": what,
                     "compiled here s": local["seconds"],
                     "through the registry s": fetched["seconds"],
                     "builds (registry)": fetched["builds"]})
    if not quick:
        run(work / "all", ["-m", "jitk", "precompile"], STEP_SECONDS)
        run(work / "all", ["-m", "jitk", "cache", "push"], STEP_SECONDS, **push)
    out, seconds = run(work / "pulled", ["-m", "jitk", "cache", "pull"], STEP_SECONDS, **pull)
    return rows, out, seconds


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0])
    with tempfile.TemporaryDirectory(prefix="jitk-bench-remote-") as temp:
        work = Path(temp)
        run(work, ["-m", "jitk", "cache", "keygen", str(work / "keys")], 60)
        try:
            with local_registry.running(work / "registry", deb_dirs=DEB_DIRS) as registry:
                rows, out, seconds = measure(work, registry.url + "/bench", args.quick)
        except local_registry.LocalRegistryError as error:
            sys.exit(f"bench_remote: {error}")
    summary = out.strip().splitlines()[-1]
    gpu = torch.cuda.is_available()
    print_table(f"first call of a cold process ({'GPU' if gpu else 'no GPU: module loads'}; "
                f"registry on loopback)", rows, list(rows[0]))
    pulled = "what the rows pushed" if args.quick else "every shipped configuration"
    print(f"\ncache pull ({pulled}): {seconds:.2f} s for the process; {summary}")
    write_json(args.json, {"rows": rows, "pull seconds": seconds, "pull": summary})


if __name__ == "__main__":
    main()
