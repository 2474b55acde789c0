"""Issue 10's deadlock scenario and its safe ordering, each for a fresh process that has
loaded no kernel of the ones it launches (CUDA loads a kernel at its first launch):

    waiter-first   stream B waits on a GPU flag, then stream A runs its first _sleep and fill_
                   and writes the flag (the issue's scenario: A's kernels load while B waits)
    writer-first   A is enqueued first (first _sleep, fill_, write), then B waits and runs a
                   kernel of its own for the first time behind the wait

After the wait, B copies the data (a copy loads no kernel); the host checks the copy.

    python tests/wait_value_deadlock.py SCENARIO   # prints "released", exit 0; may hang

`run_fresh` starts it in new processes, each under a timeout (the tests and the benchmark)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

RELEASED = "released"
SCENARIOS = ("waiter-first", "writer-first")


def main(scenario: str) -> int:
    import torch

    from jitk.kernels import wait_value

    flag = torch.tensor([0], dtype=torch.int32, device="cuda")  # a copy: launches no kernel
    data = torch.empty(1 << 20, device="cuda")
    seen = torch.empty_like(data)
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()

    def produce() -> None:
        with torch.cuda.stream(producer):
            torch.cuda._sleep(1_000_000)  # about 0.5 ms
            data.fill_(3.0)
            wait_value.stream_write_value(flag, 1)

    def consume() -> None:
        with torch.cuda.stream(consumer):
            wait_value.stream_wait_value(flag, 1)
            if scenario == "writer-first":
                data.mul_(2)  # this kernel's first launch, behind the wait
            seen.copy_(data)

    if scenario == "waiter-first":
        consume()
        produce()
    else:
        produce()
        consume()
    torch.cuda.synchronize()
    expected = 6.0 if scenario == "writer-first" else 3.0
    if not bool((seen.cpu() == expected).all()):  # checked on the host: no kernel to load
        print("the consumer read data the producer had not written yet")
        return 1
    print(RELEASED)
    return 0


def run_fresh(times: int, scenario: str, timeout_s: float = 30.0,
              env: dict[str, str] | None = None,
              stop_at_first_failure: bool = True) -> list[str]:
    """Runs `scenario` in `times` new processes, one after another; returns each outcome:
    "released", "timeout" or the failing process's last output line."""
    import jitk

    package_root = str(Path(jitk.__file__).resolve().parent.parent)
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(
        [package_root, *filter(None, [child_env.get("PYTHONPATH")])])
    outcomes = []
    for _ in range(times):
        try:
            done = subprocess.run([sys.executable, __file__, scenario], env=child_env,
                                  text=True, capture_output=True, timeout=timeout_s,
                                  check=False)
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
    if len(sys.argv) != 2 or sys.argv[1] not in SCENARIOS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(SCENARIOS)}}}")
    sys.exit(main(sys.argv[1]))
