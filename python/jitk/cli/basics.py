"""The small commands: no command (write .clangd), `demo` and `env`."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from jitk.build import clangd
from jitk.cli.common import EXIT_OK, CommandError
from jitk.tools import env


def write_clangd(args: argparse.Namespace) -> int:
    try:
        path, text = clangd.write(Path.cwd(), force=args.force)
    except clangd.ForeignConfigError as error:
        raise CommandError(str(error)) from None
    except OSError as error:
        raise CommandError(f"cannot write {error.filename}: {error.strerror}") from None
    print(f"wrote {path}:\n{text}", end="")
    return EXIT_OK


def run_demo(args: argparse.Namespace) -> int:
    try:
        demo = importlib.import_module("jitk.cli.demo")
    except ModuleNotFoundError as error:
        if error.name != "jitk.cli.demo":
            raise
        message = "this jitk installation has no demo (jitk/cli/demo.py is missing)"
        raise CommandError(message) from None
    return demo.main() or EXIT_OK


def show_env(args: argparse.Namespace) -> int:
    report = env.collect()
    print(json.dumps(report, indent=1) if args.json else env.render(report))
    return EXIT_OK


def register(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser("demo", help="run jitk's demo", description="Run jitk's demo.")
    demo.set_defaults(handler=run_demo)

    env_parser = commands.add_parser(
        "env", help="what jitk runs with, for a bug report",
        description="Print jitk's, torch's, tvm-ffi's and Python's versions, the nvcc and "
                    "host compiler jitk uses and where they come from, the GPUs and driver, "
                    "the architectures it builds for, the cache and every JITK_* setting.")
    env_parser.add_argument("--json", action="store_true",
                            help="as JSON, with the same keys on every machine")
    env_parser.set_defaults(handler=show_env)
