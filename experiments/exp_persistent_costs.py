"""Where a persistent step's time goes, and what changes the time of other work (issue 21).

1. Per item on the GPU itself: chains with a stamp item (thread 0 reads clock64 and the global
   timer) before each item of one kind (none, an empty op, scale, add, rmsnorm); the SM clock
   from the stamps.
2. Rounds of the graph's and the worker's steps, and of things a worker does, in the order
   EXP_PLAN spells (one letter a round): g graph steps (host), e graph replay (CUDA events),
   w worker steps, s worker start+stop, t a 1-block test worker start+stop, S start+stop on
   the capture's stream, j a plain jitk kernel, k a sleep kernel on a side stream, p a pinned
   allocation, m the worker's module load, G the GEMM alone (events), z the host sleeps 3 s,
   0-6 probe kernels (0 global timer reads, 1 __nanosleep, 2 PCIe loads, 3 fence.sys,
   4 fence.gpu, 5 __nanosleep(32), 6 ten __nanosleep(1000)). Which of them leave the graph
   slower afterwards found the __nanosleep effect noted at jitk::device::pause_ns.
3. Unless EXP_STAMPS_ONLY is set: the GEMM's kernels (name, grid, block, shared memory) from
   the profiler, per-item slopes by op, and the GEMM beside resident kernels in rounds, with
   nvidia-smi's SM clock, power and temperature.

    EXP_PLAN=ee6ee python benchmarks/exp_persistent_costs.py [--quick] [--json PATH]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

import torch  # noqa: E402
from bench_persistent import (  # noqa: E402
    BLOCKS,
    GEMM,
    OPS,
    SHORT_OPS,
    N,
    eager_chain,
    gated_us,
    host_us,
)
from common import device_name, parse_args, print_table, write_json  # noqa: E402
from persistent_cases import chain_items, chain_worker, test_worker  # noqa: E402

from jitk.build.jit import load_jit  # noqa: E402
from jitk.persistent import CHAIN_OPS, IntArg, Op, TensorArg, Worker  # noqa: E402
from jitk.tools.timing import captured_graph, median_us  # noqa: E402

SPIN_CYCLES = int(4e8)  # about 0.2 s at the H100's clocks: longer than 10 gated GEMMs


def one_kind_chain(kind, x, w, bufs, n):
    items, src = [], x
    for i in range(n):
        dst = bufs[i % 2]
        args = {"rmsnorm": dict(x=src, w=w, y=dst, eps=1e-6),
                "scale": dict(x=src, y=dst, factor=1.0),
                "add": dict(x=src, b=x, y=dst)}[kind]
        items.append((kind, args))
        src = dst
    return items


def slopes(steps: int) -> list[dict]:
    x = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    bufs = [torch.empty_like(x) for _ in range(2)]
    rows = []
    worker = chain_worker(capacity=1024)
    kinds = {k: (lambda n, k=k: one_kind_chain(k, x, w, bufs, n)) for k in
             ("scale", "add", "rmsnorm")}
    kinds["mixed"] = lambda n: chain_items(x, w, bufs, n)[0]
    worker.start(blocks=BLOCKS)
    try:
        for kind, make in kinds.items():
            batches = {n: worker.prepare(make(n), chain=True) for n in (SHORT_OPS, OPS)}
            for b in batches.values():
                worker.wait(worker.push_many(b)[-1])
            t = {n: host_us(lambda b=b: worker.wait(worker.push_many(b)[-1]), steps)
                 for n, b in batches.items()}
            rows.append({"chain": kind, "step_180_us": t[OPS],
                         "per_item_us": (t[OPS] - t[SHORT_OPS]) / (OPS - SHORT_OPS)})
        batch = worker.prepare(chain_items(x, w, bufs, OPS)[0], chain=True)
        push = []
        for _ in range(steps):
            start = time.perf_counter()
            last = worker.push_many(batch)[-1]
            push.append((time.perf_counter() - start) * 1e6)
            worker.wait(last)
        rows.append({"chain": "mixed: push_many() alone", "step_180_us": statistics.median(push)})
    finally:
        worker.stop(timeout=30)
    worker = test_worker(capacity=1024)
    worker.start(blocks=BLOCKS)
    try:
        batches = {n: worker.prepare([("nothing", {"unused": 0})] * n, chain=True)
                   for n in (SHORT_OPS, OPS)}
        t = {n: host_us(lambda b=b: worker.wait(worker.push_many(b)[-1]), steps)
             for n, b in batches.items()}
        rows.insert(0, {"chain": "nothing", "step_180_us": t[OPS],
                        "per_item_us": (t[OPS] - t[SHORT_OPS]) / (OPS - SHORT_OPS)})
    finally:
        worker.stop(timeout=30)
    return rows


STAMP = Op("stamp", "persistent_exp::Stamp", (TensorArg("out", torch.int64, (None,)),
                                               IntArg("index")))
PASS = Op("pass", "persistent_exp::Pass", (IntArg("unused"),))


def stamped(steps: int) -> list[dict]:
    """Per item on the GPU itself: chains of stamps alone, and stamps between items of one
    op kind; the SM clock's rate from the stamps' clock64 over their global timer."""
    x = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    bufs = [torch.empty_like(x) for _ in range(2)]
    worker = Worker("exp", ["persistent_chain.cuh", os.path.join(HERE,
                                                                  "exp_persistent_ops.cuh")],
                    (*CHAIN_OPS, STAMP, PASS), capacity=1024)
    out = torch.zeros(2 * 200, dtype=torch.int64, device="cuda")
    rows = []
    worker.start(blocks=BLOCKS)
    try:
        for kind in ("stamps only", "pass", "scale", "add", "rmsnorm"):
            ops = [] if kind == "stamps only" else [("pass", {"unused": 0})] * 90 \
                if kind == "pass" else one_kind_chain(kind, x, w, bufs, 90)
            items = []
            for i in range(91):
                items.append(("stamp", dict(out=out, index=i)))
                if ops and i < 90:
                    items.append(ops[i])
            batch = worker.prepare(items, chain=True)
            cycles, ns, mhz = [], [], []
            for _ in range(steps):
                worker.wait(worker.push_many(batch)[-1])
                stamps = out[:2 * 91].view(91, 2).cpu()
                d = stamps[1:] - stamps[:-1]
                cycles.append(d[:, 0].float().median().item())
                ns.append(d[:, 1].float().median().item())
                total = stamps[-1] - stamps[0]
                mhz.append(total[0].item() / max(total[1].item(), 1) * 1e3)
            rows.append({"chain": kind, "cycles_per_pair": statistics.median(cycles),
                         "ns_per_pair": statistics.median(ns), "sm_mhz": statistics.median(mhz)})
    finally:
        worker.stop(timeout=30)
    return rows


class Sampler:
    """nvidia-smi sampling SM clock, power and temperature every 20 ms into a file."""

    def __init__(self):
        self.path = tempfile.mktemp(suffix=".csv")
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
             "--format=csv,noheader,nounits", "-lms", "20", "-f", self.path])

    def samples(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)
        out = []
        with open(self.path) as f:
            for line in f:
                parts = [p.strip() for p in line.split(",")]
                try:
                    stamp = time.mktime(time.strptime(parts[0][:19], "%Y/%m/%d %H:%M:%S"))
                    stamp += float("0" + parts[0][19:])
                    out.append((stamp, float(parts[1]), float(parts[2]), float(parts[3])))
                except (ValueError, IndexError):
                    continue
        return out


def gemm_interleaved(rounds: int) -> list[dict]:
    a = torch.randn(GEMM, GEMM, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(GEMM, GEMM, device="cuda", dtype=torch.bfloat16)
    gemm = lambda: torch.mm(a, b)  # noqa: E731
    side = torch.cuda.Stream()
    gated_us(gemm, repeats=3)
    with torch.cuda.stream(side):
        torch.cuda._sleep(1000)
    side.synchronize()
    workers = {8: test_worker(capacity=256), 1: test_worker(capacity=256)}
    for wk in workers.values():
        wk._kernels.max_blocks(0)

    def beside_spin():
        with torch.cuda.stream(side):
            torch.cuda._sleep(SPIN_CYCLES)
        time.sleep(0.002)
        t = gated_us(gemm, repeats=10)
        side.synchronize()
        return t

    def beside_worker(blocks):
        def run():
            wk = workers[blocks].start(blocks=blocks)
            try:
                time.sleep(0.002)
                return gated_us(gemm, repeats=10)
            finally:
                wk.stop(timeout=30)
        return run

    phases = [("alone", lambda: gated_us(gemm, repeats=10)), ("1-thread spin", beside_spin),
              ("alone", lambda: gated_us(gemm, repeats=10)), ("worker 8 blocks idle",
                                                               beside_worker(8)),
              ("alone", lambda: gated_us(gemm, repeats=10)), ("worker 1 block idle",
                                                               beside_worker(1))]
    sampler = Sampler()
    time.sleep(0.2)
    record = []
    for r in range(rounds):
        for label, fn in phases:
            start = time.time()
            us = fn()
            record.append((r, label, us, start, time.time()))
    time.sleep(0.1)
    samples = sampler.samples()
    rows = []
    for r, label, us, start, end in record:
        inside = [s for s in samples if start <= s[0] <= end]
        row = {"round": r, "phase": label, "gemm_ms": us / 1e3}
        if inside:
            row["sm_mhz"] = statistics.mean(s[1] for s in inside)
            row["watts"] = statistics.mean(s[2] for s in inside)
            row["celsius"] = max(s[3] for s in inside)
        rows.append(row)
    # Each beside-phase against the mean of the alone phases either side of it.
    for i, row in enumerate(rows):
        if row["phase"] != "alone":
            near = [rows[j]["gemm_ms"] for j in (i - 1, i + 1)
                    if 0 <= j < len(rows) and rows[j]["phase"] == "alone"]
            row["vs_adjacent_alone"] = row["gemm_ms"] / statistics.mean(near) - 1
    return rows


def gemm_kernels() -> list[dict]:
    a = torch.randn(GEMM, GEMM, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(GEMM, GEMM, device="cuda", dtype=torch.bfloat16)
    torch.mm(a, b)
    torch.cuda.synchronize()
    path = tempfile.mktemp(suffix=".json")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.mm(a, b)
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    rows = []
    for e in events:
        if e.get("cat") == "kernel":
            args = e.get("args", {})
            rows.append({"kernel": e["name"][:90], "grid": str(args.get("grid")),
                         "block": str(args.get("block")),
                         "smem": args.get("shared memory"),
                         "regs": args.get("registers per thread"),
                         "us": e.get("dur")})
    return rows


def graph_vs_worker_clocks(steps: int, rounds: int) -> list[dict]:
    """Alternating rounds of the graph's and the worker's steps (as bench_persistent.py runs
    them), with the SM clock nvidia-smi saw during each."""
    x = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    bufs = [torch.empty_like(x) for _ in range(2)]
    graph = captured_graph(eager_chain(x, w, bufs, OPS), calls_per_graph=1)
    side = torch.cuda.Stream()  # for the side-stream probes
    worker = chain_worker(capacity=1024)
    batch = worker.prepare(chain_items(x, w, bufs, OPS)[0], chain=True)

    def graph_round():
        for _ in range(5):
            graph.replay()
            torch.cuda.synchronize()
        return host_us(lambda: (graph.replay(), torch.cuda.synchronize()), steps)

    def worker_round():
        worker.start(blocks=BLOCKS)
        try:
            for _ in range(5):
                worker.wait(worker.push_many(batch)[-1])
            return host_us(lambda: worker.wait(worker.push_many(batch)[-1]), steps)
        finally:
            worker.stop(timeout=30)

    def start_stop():
        worker.start(blocks=BLOCKS)
        worker.stop(timeout=30)
        return 0.0

    def events_round():
        return median_us(graph.replay, repeats=steps, warmup=2)

    def side_sleep():
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(2e7))  # about 10 ms
        side.synchronize()
        return 0.0

    def pinned():
        keep.append(torch.full((1024 * 16,), -1, dtype=torch.int64, pin_memory=True))
        return 0.0

    def module_only():
        worker._kernels.max_blocks(0)
        return 0.0

    def test_worker_one_block():
        other = test_worker(capacity=64)
        other.start(blocks=1)
        other.stop(timeout=30)
        return 0.0

    def start_stop_on_side():
        worker.start(blocks=BLOCKS, stream=side)
        worker.stop(timeout=30)
        return 0.0

    def jitk_kernel():
        from jitk.kernels.green import sm_ids
        sm_ids(16, side)
        return 0.0

    probes = load_jit("persistent_exp_probe", cuda_files=[os.path.join(HERE,
                                                                      "exp_lasting.cuh")],
                      cuda_wrappers=[("probe", "persistent_exp::probe")])
    host_word = torch.zeros(16, dtype=torch.int64, pin_memory=True)
    sink = torch.zeros(1, dtype=torch.int64, device="cuda")

    def probe(kind):
        def run():
            probes.probe(kind, host_word.data_ptr(), 20000, sink, side.cuda_stream)
            side.synchronize()
            return 0.0
        return run

    a = torch.randn(GEMM, GEMM, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(GEMM, GEMM, device="cuda", dtype=torch.bfloat16)

    def gemm_events():
        return median_us(lambda: torch.mm(a, b), repeats=10, warmup=2)

    def host_sleep():
        time.sleep(3)
        return 0.0

    keep = []
    plan = os.environ.get("EXP_PLAN", "ggwgwgw")
    record = []
    for r, code in enumerate(plan):
        fn = {"g": graph_round, "w": worker_round, "s": start_stop, "e": events_round,
              "k": side_sleep, "p": pinned, "m": module_only, "t": test_worker_one_block,
              "S": start_stop_on_side, "j": jitk_kernel, "0": probe(0), "1": probe(1),
              "2": probe(2), "3": probe(3), "4": probe(4), "5": probe(5), "6": probe(6),
              "G": gemm_events, "z": host_sleep}[code]
        record.append({"round": r, "what": {"g": "graph (host)", "w": "worker",
                                            "s": "worker start+stop only",
                                            "e": "graph (events)",
                                            "k": "10 ms sleep kernel on a side stream",
                                            "p": "pinned allocation",
                                            "m": "worker module load, occupancy",
                                            "t": "test worker, 1 block, start+stop",
                                            "S": "start+stop on the capture's stream",
                                            "j": "a jitk kernel (sm_ids) on a side stream",
                                            "0": "probe: globaltimer reads",
                                            "1": "probe: nanosleep", "2": "probe: PCIe loads",
                                            "3": "probe: fence.sys", "4": "probe: fence.gpu",
                                            "5": "probe: nanosleep(32)",
                                            "6": "probe: 10 nanosleep(1000)",
                                            "G": f"GEMM bf16 {GEMM}^3 (events)",
                                            "z": "host sleeps 3 s"}[code],
                       "step_us": fn()})
    return record


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    steps = 50 if args.quick else 200
    torch.manual_seed(0)
    print(device_name())
    stamps = stamped(steps)
    print_table("Per item on the GPU: a stamp (thread 0 reads the clocks) before each item, "
                "median gap", stamps, ["chain", "cycles_per_pair", "ns_per_pair", "sm_mhz"])
    clocks = graph_vs_worker_clocks(steps, 6)
    print_table("Graph and worker steps in rounds (EXP_PLAN)", clocks,
                ["round", "what", "step_us"])
    if os.environ.get("EXP_STAMPS_ONLY"):
        return
    kernels = gemm_kernels()
    print_table("The GEMM's kernels", kernels, ["kernel", "grid", "block", "smem", "regs", "us"])
    rows = slopes(steps)
    print_table("Per item by op (slope 18 -> 180 items), 8 blocks", rows,
                ["chain", "step_180_us", "per_item_us"])
    interleaved = gemm_interleaved(3 if args.quick else 5)
    print_table("GEMM interleaved (10 gated runs a phase, median)", interleaved,
                ["round", "phase", "gemm_ms", "vs_adjacent_alone", "sm_mhz", "watts", "celsius"])
    write_json(args.json, {"device": device_name(), "kernels": kernels, "slopes": rows,
                           "interleaved": interleaved})


if __name__ == "__main__":
    main()
