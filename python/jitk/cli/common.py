"""What the command modules share: exit codes, the errors main() reports, argument types
and the argument definitions more than one command takes."""

from __future__ import annotations

import argparse
import os

from jitk.base.errors import JitkError
from jitk.build import toolchain
from jitk.tools import precompile

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class CommandError(JitkError, RuntimeError):
    """A failure to report in one line and exit 1."""


class UsageError(CommandError):
    """A command that cannot run as given: reported in one line, exit 2."""


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def valid_arch(text: str) -> str:
    try:
        toolchain.parse_archs(text)
    except toolchain.ToolchainError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def add_jobs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--jobs", "-j", type=positive_int, metavar="N",
                        help="builds at a time (default: the number of CPUs)")


def add_dtypes(parser: argparse.ArgumentParser, text: str,
               default: list[str] | None = None) -> None:
    parser.add_argument("--dtype", nargs="+", default=default, metavar="DTYPE", help=text)


def default_precompile_archs() -> list[str]:
    """$JITK_CUDA_ARCH (as one target, as a process with it set would build), else the
    current GPU's."""
    setting = os.environ.get(toolchain.ARCH_ENV)
    if setting:
        toolchain.parse_archs(setting)  # a bad setting fails here, before any build
        return [setting]
    capability = toolchain.current_gpu_capability()
    if capability is None:
        raise UsageError(f"no architecture to build for: pass --arch (e.g. --arch 9.0), set "
                         f"{toolchain.ARCH_ENV}, or run on a machine with a GPU")
    return [f"{capability[0]}.{capability[1]}"]


def selected_ops(names: list[str]) -> list:
    """The OpInfo of each named op (bare or qualified), or of every registered op: the
    shipped kernel modules' and those in $JITK_PRECOMPILE_MODULES."""
    from jitk.runtime.op import find_op, registered_ops

    for name in precompile.registered_modules():
        precompile.import_kernel_module(name)
    try:
        return [find_op(name) for name in names] if names else list(registered_ops().values())
    except KeyError as error:
        raise UsageError(error.args[0]) from None
