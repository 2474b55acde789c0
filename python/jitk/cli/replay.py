"""`python -m jitk replay DUMP`: run a call dumped at JITK_LOGLEVEL=10 again and compare
its outputs."""

from __future__ import annotations

import argparse
from pathlib import Path

from jitk.cli.common import EXIT_FAILURE, EXIT_OK, UsageError


def run_replay(args: argparse.Namespace) -> int:
    from jitk.tools import replay

    try:
        call, runs = replay.replay(args.dump, args.device)
    except replay.DumpError as error:
        raise UsageError(str(error)) from None
    status = "raised " + call["raised"] if call.get("raised") else \
        "never returned (no outputs dumped)" if call.get("outputs") is None else \
        f"{len(call['outputs'])} output(s) dumped"
    print(f"{call['op']} call {call['call']} of pid {call['pid']}: {status}")
    for run in runs:
        if run.passed:
            against = f"matches the {run.compared} dumped output(s)" if run.compared else \
                "ran (nothing dumped to compare with)"
            print(f"  {run.what}: {against}")
        else:
            print(f"  {run.what}: FAILED")
            for line in run.failures:
                print(f"    {line}")
    return EXIT_OK if all(run.passed for run in runs) else EXIT_FAILURE


def register(commands: argparse._SubParsersAction) -> None:
    replay = commands.add_parser(
        "replay", help="run a dumped call again and compare its outputs",
        description="Run a call dumped at JITK_LOGLEVEL=10 again from its input tensors and "
                    "compare what it writes and returns with the dumped outputs, then the "
                    "same for the op's reference, if it has one. Exits 1 when a run differs "
                    "or raises.")
    replay.add_argument("dump", type=Path, metavar="DUMP",
                        help="a dump folder (JITK_DUMP_DIR/<op>_pid<pid>_call<n>)")
    replay.add_argument("--device", metavar="DEVICE",
                        help="run on this device (e.g. cpu) instead of the recorded one")
    replay.set_defaults(handler=run_replay)
