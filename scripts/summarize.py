"""The short table gpu_check.sh prints last: headline figures from the benchmarks' JSON."""

import json
import sys
from pathlib import Path


def load(folder: Path, name: str) -> dict:
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def fmt(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def main(folder: Path) -> None:
    lines = []
    core = load(folder, "bench_core")
    lines += [(row["what"], fmt(row["value"])) for row in core.get("rows", [])]
    hicache = load(folder, "bench_hicache")
    for row in hicache.get("rows", []):
        lines.append((f"hicache {row['direction']} {row['tokens']} tok x {row['bytes/token']} B",
                      f"{fmt(row['jitk GB/s'])} GB/s = {row['ratio']:.0%} of "
                      f"{fmt(row['ceiling GB/s'])}, "
                      f"{row.get('vs same-size copy', 0):.0%} of same-size copy"))
    rmsnorm = load(folder, "bench_rmsnorm")
    for row in rmsnorm.get("rows", []):
        lines.append((f"rmsnorm {row['dtype']} {row['shape']} (graph)",
                      f"{fmt(row['jitk graph us'])} us, {row['of copy']:.0%} of copy, "
                      f"{row.get('vs same-size copy', 0):.0%} of same-size copy, "
                      f"{fmt(row['speedup graph'])}x torch, goal {row['goal']}"))
    wait = load(folder, "bench_wait_value")
    lines += [(f"wait_value {row['figure']}", fmt(row["value"]))
              for row in wait.get("rows", []) if "figure" in row]
    device = next((d.get("device") for d in (core, hicache, rmsnorm, wait) if d.get("device")), "?")
    print(f"\n== headline figures ({device}) ==")
    width = max((len(name) for name, _ in lines), default=0)
    for name, value in lines:
        print(f"{name.ljust(width)}  {value}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
