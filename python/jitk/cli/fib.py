"""`python -m jitk fib export|workloads`: FlashInfer-Bench Definitions, jitk's Solutions
and Workloads from call logs (jitk/integrations/fib.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from jitk.cli.common import EXIT_OK, CommandError, UsageError, add_dtypes


def run_fib_export(args: argparse.Namespace) -> int:
    from jitk.integrations import fib

    try:
        sizes = {"hidden": args.hidden, "dtypes": args.dtype, "eps": args.eps}
        ops = [*args.op, *(op for family in args.family or () for op in fib.FAMILIES[family])]
        written = fib.export(args.out_dir, ops or None,
                             **{key: value for key, value in sizes.items() if value})
    except fib.FibUnavailableError as error:
        raise CommandError(str(error)) from None
    except (KeyError, ValueError, TypeError) as error:
        raise UsageError(error.args[0]) from None
    except OSError as error:
        raise CommandError(f"cannot write {error.filename}: {error.strerror}") from None
    for path in written:
        print(path)
    return EXIT_OK


def run_fib_workloads(args: argparse.Namespace) -> int:
    from jitk.integrations import fib

    try:
        counts = fib.workloads(args.logs, args.out_dir)
    except fib.FibUnavailableError as error:
        raise CommandError(str(error)) from None
    except ValueError as error:
        raise UsageError(error.args[0]) from None
    if not counts:
        raise CommandError(f"no jitk.rmsnorm or jitk.fused_add_rmsnorm call in "
                           f"{', '.join(map(str, args.logs))} (logged at JITK_LOGLEVEL=3 or more?)")
    for definition, count in sorted(counts.items()):
        print(f"{definition}: {count} workload{'s' if count != 1 else ''}")
    return EXIT_OK


def register(commands: argparse._SubParsersAction) -> None:
    fib_parser = commands.add_parser(
        "fib", help="FlashInfer-Bench: Definitions, jitk's Solutions and Workloads",
        usage="%(prog)s [-h] {export,workloads} ...",
        description="FlashInfer-Bench (pip install jitk[fib]).")
    fib_actions = fib_parser.add_subparsers(title="actions", metavar="ACTION",
                                            prog=fib_parser.prog, required=True)
    export = fib_actions.add_parser(
        "export", help="write Definitions and jitk's Solutions as a TraceSet folder",
        description="Write FlashInfer-Bench Definitions (OUT_DIR/definitions/<op_type>/"
                    "<name>.json): RMSNorm's in the dataset's form (rmsnorm_h<N>, "
                    "fused_add_rmsnorm_h<N>) at each hidden size, dtype and eps, with jitk's "
                    "Solutions (OUT_DIR/solutions/...), and jitk's own for the HiCache "
                    "transfers (one-layer and all-layer, K/V and MLA) at each dtype.")
    export.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    export.add_argument("op", nargs="*", metavar="OP",
                        help="op names (e.g. rmsnorm or jitk::rmsnorm); default: all")
    export.add_argument("--family", nargs="+", choices=("norm", "hicache"),
                        help="every op of these kernel families (added to OP)")
    export.add_argument("--hidden", type=int, nargs="+", metavar="N",
                        help="RMSNorm hidden sizes (default: common model widths)")
    add_dtypes(export, "dtypes of bfloat16 (default, the dataset's), float16, float32")
    export.add_argument("--eps", type=float, nargs="+", metavar="EPS",
                        help="RMSNorm eps (default: the dataset's)")
    export.set_defaults(handler=run_fib_export)
    from_logs = fib_actions.add_parser(
        "workloads", help="turn JITK_LOGLEVEL>=3 call logs into Workloads",
        description="Write OUT_DIR/workloads/rmsnorm/<definition>.jsonl from the logged calls "
                    "of jitk.rmsnorm and jitk.fused_add_rmsnorm (random inputs of each logged "
                    "shape; a call dumped at JITK_LOGLEVEL=10 keeps its tensors), with their "
                    "Definitions and jitk's Solutions.")
    from_logs.add_argument("logs", type=Path, nargs="+", metavar="LOG")
    from_logs.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    from_logs.set_defaults(handler=run_fib_workloads)
