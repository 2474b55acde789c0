"""`python -m jitk check [OP ...]`: run ops against their references; `--invariance`:
RMSNorm's batch invariance on the GPU."""

from __future__ import annotations

import argparse
import importlib

from jitk.cli.common import EXIT_FAILURE, EXIT_OK, CommandError, UsageError, selected_ops


def run_check(args: argparse.Namespace) -> int:
    from jitk.tools import testing

    for module in args.imports:  # the user's own ops register as their module is imported
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise UsageError(f"--import {module}: {error}") from None
    if args.invariance:
        return run_invariance_check(args)
    if args.full:
        raise UsageError("--full applies only with --invariance")
    failed = []
    for info in selected_ops(args.op):
        if info.reference is None or info.cases is None:
            print(f"{info.name}: skipped, it declares no "
                  f"{'reference' if info.reference is None else 'cases'}")
            continue
        reports = testing.check_op(info, device=args.device, raise_on_failure=False)
        bad = [r for r in reports if not r.ok]
        if all(r.tensor == "opcheck" for r in reports):
            print(f"{info.name}: {len(reports) - len(bad)} of {len(reports)} cases pass "
                  "opcheck in reference mode (no GPU: kernels not run)")
        else:
            worst = max((r.max_ulps for r in reports), default=0.0)
            print(f"{info.name}: {len(reports) - len(bad)} of {len(reports)} comparisons "
                  f"within tolerance (max {worst:.3g} ulps)")
        for report in reports if args.verbose else bad:
            print(f"  {report.line()}")
        failed += bad
    return EXIT_FAILURE if failed else EXIT_OK


def run_invariance_check(args: argparse.Namespace) -> int:
    """RMSNorm's rows alone against the same rows in batches, bitwise, for every choice the
    tuner may pick and the public entry points (jitk.kernels.norm.invariance)."""
    import torch

    if args.op or args.device == "cpu":
        raise UsageError("--invariance checks RMSNorm on the GPU: it takes no op names and "
                         "no --device cpu")
    if not torch.cuda.is_available():
        raise CommandError("--invariance runs kernels on a GPU, and none is visible")
    from jitk.kernels.norm import invariance

    findings = invariance.check(full=args.full)
    wrong = [f for f in findings if f.differing]
    for finding in findings if args.verbose else wrong:
        print(f"  {finding.line()}")
    print(f"rmsnorm invariance: {len(wrong)} case(s) with differing or inaccurate rows "
          f"(widths {', '.join(map(str, invariance.WIDTHS))}; rows {invariance.ROWS}; "
          f"{'every choice' if args.full else 'a sample of the choices'})")
    return EXIT_FAILURE if wrong else EXIT_OK


def register(commands: argparse._SubParsersAction) -> None:
    check = commands.add_parser(
        "check", help="run ops against their references",
        description="Run each op (default: every registered one) against its reference over "
                    "its cases: on the GPU, results compared (abs, rel, ulps) within the op's "
                    "tolerance; without one, torch.library.opcheck in reference mode.")
    check.add_argument("op", nargs="*", help="op names, bare or qualified (default: all)")
    check.add_argument("--device", choices=("cuda", "cpu"),
                       help="where to run (default: the GPU if there is one)")
    check.add_argument("--verbose", "-v", action="store_true", help="print every case")
    check.add_argument("--import", dest="imports", action="append", default=[],
                       metavar="MODULE", help="import MODULE first, for ops it defines "
                       "(repeatable)")
    check.add_argument("--invariance", action="store_true",
                       help="RMSNorm's batch invariance on the GPU: rows alone against the same "
                            "rows in batches of 1-4096, bitwise, for the tuner's choices and "
                            "the shipped table, plus accuracy against float64")
    check.add_argument("--full", action="store_true",
                       help="with --invariance: every choice the tuner may pick, not a sample")
    check.set_defaults(handler=run_check)
