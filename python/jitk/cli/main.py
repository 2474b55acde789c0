"""The jitk command line: `python -m jitk [command]`.

  (no command)  write .clangd here, so clangd understands jitk kernels
  demo          run jitk's demo
  cache         list the module cache; `cache clear` empties it, `cache prune` trims it
  precompile    build the kernels' common configurations into the cache ahead of time
  replay        run a call dumped at JITK_LOGLEVEL=10 again and check its outputs
  fib export    write FlashInfer-Bench Definitions (and jitk's Solutions) of the ops
  fib workloads turn JITK_LOGLEVEL>=3 call logs into FlashInfer-Bench Workloads
  check         run ops against their references (python -m jitk check [OP ...])
  tune          time the ops' launch choices on this GPU, record the fastest
  env           what jitk runs with (versions, compilers, GPUs, cache, settings); --json

Each command's arguments and handler are in its own module (jitk/cli/<command>.py; the
no-command default, demo and env in basics.py); this one assembles the parser and reports
errors.

Exit codes: 0 success, 1 failure, 2 bad usage."""

from __future__ import annotations

import argparse
import sys
import warnings

from jitk.base import NUMPY_WARNING
from jitk.base.errors import PREFIX
from jitk.build import toolchain
from jitk.build.lock import JitLockError
from jitk.build.signing import RemoteCacheError
from jitk.cli import basics, cache, check, fib, precompile, replay, tune
from jitk.cli.common import EXIT_FAILURE, EXIT_USAGE, CommandError, UsageError
from jitk.tools.precompile import PrecompileError

warnings.filterwarnings("ignore", NUMPY_WARNING, UserWarning)  # see jitk/__init__.py

COMMANDS = (basics, cache, precompile, replay, fib, check, tune)  # in the order --help lists


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jitk", usage="%(prog)s [-h] [--force] [COMMAND ...]",
        description="Without a command: write .clangd in the current directory, so that "
                    "clangd understands kernels that include <jitk/...> headers.",
        epilog="Exit codes: 0 success, 1 failure, 2 bad usage.")
    parser.add_argument("--force", action="store_true",
                        help="replace a .clangd that jitk did not write")
    parser.set_defaults(handler=basics.write_clangd)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", prog=parser.prog)
    for command in COMMANDS:
        command.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.force and args.handler is not basics.write_clangd:
        parser.error("--force only applies to writing .clangd (no command)")
    try:
        return args.handler(args)
    except UsageError as error:
        parser.exit(EXIT_USAGE, f"jitk: error: {_said(error)}\n")
    except (CommandError, PrecompileError, toolchain.ToolchainError,
            JitLockError, RemoteCacheError, ValueError) as error:  # ValueError: a bad setting
        print(f"jitk: error: {_said(error)}", file=sys.stderr)
        return EXIT_FAILURE


def _said(error: Exception) -> str:
    """An error's message without the "jitk: " every jitk error starts with (the command
    line writes its own)."""
    return str(error).removeprefix(PREFIX)


if __name__ == "__main__":
    sys.exit(main())
