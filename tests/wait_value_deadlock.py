"""The scenario that hung every run while waits were spin kernels (issue 10), for a fresh
process with no warm-up: stream B waits on a GPU flag and enqueues a kernel this process has
never launched; stream A then runs its first torch.cuda._sleep and fill_ and writes the flag.
Lazy loading loads those kernels while B's wait is in place.

    python tests/wait_value_deadlock.py     # prints "released", exit 0; hangs if it deadlocks

`run_fresh` starts it in new processes, each under a timeout (the tests and the benchmark)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

RELEASED = "released"


def main() -> int:
    import torch

    from jitk import wait_value

    flag = torch.tensor([0], dtype=torch.int32, device="cuda")  # a copy: launches no kernel
    data = torch.empty(1 << 20, device="cuda")
    seen = torch.empty_like(data)
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(consumer):
        wait_value.stream_wait_value(flag, 1)
        torch.mul(data, 2, out=seen)  # loaded at this first launch, behind the wait
    with torch.cuda.stream(producer):
        torch.cuda._sleep(1_000_000)  # about 0.5 ms: the wait is in place long before
        data.fill_(3.0)
        wait_value.stream_write_value(flag, 1)
    torch.cuda.synchronize()
    if not bool((seen == 6).all()):
        print("the consumer read data the producer had not written yet")
        return 1
    print(RELEASED)
    return 0


def run_fresh(times: int, timeout_s: float = 30.0, env: dict[str, str] | None = None,
              stop_at_first_failure: bool = True) -> list[str]:
    """Runs the scenario in `times` new processes, one after another; returns each outcome:
    "released", "timeout" or the failing process's last output line."""
    import jitk

    package_root = str(Path(jitk.__file__).resolve().parent.parent)
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(
        [package_root, *filter(None, [child_env.get("PYTHONPATH")])])
    outcomes = []
    for _ in range(times):
        try:
            done = subprocess.run([sys.executable, __file__], env=child_env, text=True,
                                  capture_output=True, timeout=timeout_s, check=False)
            lines = (done.stdout + done.stderr).strip().splitlines()
            outcome = RELEASED if done.returncode == 0 and lines[-1:] == [RELEASED] else (
                f"exit {done.returncode}: {lines[-1] if lines else ''}")
        except subprocess.TimeoutExpired:
            outcome = "timeout"
        outcomes.append(outcome)
        if outcome != RELEASED and stop_at_first_failure:
            break
    return outcomes


if __name__ == "__main__":
    sys.exit(main())
