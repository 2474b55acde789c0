"""`python -m jitk precompile`: build the kernels' common configurations, or recorded
load_jit calls, into the cache ahead of time."""

from __future__ import annotations

import argparse
import os
import sys
import time

from jitk.build import cache, toolchain
from jitk.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    CommandError,
    UsageError,
    add_jobs,
    default_precompile_archs,
    valid_arch,
)
from jitk.tools import precompile


def selected_modules(chosen: list[str] | None) -> list[str]:
    registered = precompile.registered_modules()
    chosen = [precompile.module_named(name) for name in chosen or ()]
    unknown = [name for name in chosen if name not in registered]
    if unknown:
        raise UsageError(f"unknown kernel module(s) {', '.join(unknown)}; known: "
                         f"{', '.join(registered)} (add more with {precompile.MODULES_ENV})")
    return chosen or registered


def print_configs(labels: dict[str, list[str]]) -> None:
    for module, module_labels in labels.items():
        print(f"{module}: {len(module_labels)} configuration(s)")
        for label in module_labels:
            print(f"  {label}")


def print_summary(outcomes: list[precompile.Outcome], wall: float, jobs: int) -> None:
    for module in dict.fromkeys(o.task.module for o in outcomes):
        mine = [o for o in outcomes if o.task.module == module]
        failed = sum(o.error is not None for o in mine)
        built = sum(o.built and o.error is None for o in mine)
        print(f"{precompile.short_name(module)}: {sum(o.seconds for o in mine):.1f} s over "
              f"{len(mine)} configuration(s) ({built} built, {len(mine) - built - failed} "
              f"cached" + (f", {failed} failed)" if failed else ")"))
    print(f"{len(outcomes)} configuration(s) in {wall:.1f} s wall time with {jobs} job(s); "
          f"cache: {cache.cache_root()}")


def precompile_tasks(args: argparse.Namespace) -> list[precompile.Task]:
    """The recorded calls (--call), else every configuration of the selected modules."""
    if args.call:
        if args.module or args.list:
            raise UsageError("--call builds the calls given, so --module and --list do not "
                             "apply")
        cuda = any(precompile.is_cuda_call(call) for call in args.call)
        archs = checked_archs(args.arch or (default_precompile_archs() if cuda else []))
        return precompile.call_tasks(args.call, archs)
    labels, missing = precompile.config_labels(selected_modules(args.module))
    for name in missing:
        print(f"{name} is not installed; skipped", file=sys.stderr)
    if args.list:
        print_configs(labels)
        return []
    if not any(labels.values()):
        raise CommandError("no kernel configurations to precompile")
    return precompile.make_tasks(labels, checked_archs(args.arch or default_precompile_archs()))


def checked_archs(archs: list[str]) -> list[str]:
    for arch in archs:
        try:
            toolchain.check_buildable(toolchain.parse_archs(arch))
        except toolchain.ToolchainError as error:
            raise UsageError(str(error)) from None
    return archs


def run_precompile(args: argparse.Namespace) -> int:
    tasks = precompile_tasks(args)
    if not tasks:  # --list printed them
        return EXIT_OK
    jobs = args.jobs or os.cpu_count() or 1
    started = time.perf_counter()
    outcomes = precompile.run(tasks, jobs, precompile.Progress(len(tasks)))
    print_summary(outcomes, time.perf_counter() - started, min(jobs, len(tasks)))
    failed = [o for o in outcomes if o.error]
    for outcome in failed:
        print(f"\nFAILED: {outcome.task.describe()}\n{outcome.error}", file=sys.stderr)
    if failed:
        names = ", ".join(o.task.describe() for o in failed)
        print(f"\njitk: {len(failed)} build(s) failed: {names}", file=sys.stderr)
    return EXIT_FAILURE if failed else EXIT_OK


def recorded_call(text: str) -> str:
    try:
        precompile.read_call(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def register(commands: argparse._SubParsersAction) -> None:
    build = commands.add_parser(
        "precompile", help="build the kernels' common configurations into the cache",
        description="Build every precompile_configs() entry of the kernel modules "
                    f"({', '.join(precompile.KERNEL_MODULES)} and those named in "
                    f"${precompile.MODULES_ENV}) into the cache, so that a later first call "
                    "only loads.")
    build.add_argument("--arch", action="append", type=valid_arch, metavar="ARCH",
                       help="a JITK_CUDA_ARCH value to build for, e.g. 9.0; repeat for "
                            f"more (default: ${toolchain.ARCH_ENV}, else the current GPU's)")
    add_jobs(build)
    build.add_argument("--module", action="append", metavar="NAME",
                       help="only this kernel module; repeat for more (default: all)")
    build.add_argument("--list", action="store_true",
                       help="print the configurations and build nothing")
    build.add_argument("--call", action="append", type=recorded_call, metavar="JSON",
                       help="build exactly the entry of this load_jit call, as a cache miss's "
                            "message records it; repeat for more")
    build.set_defaults(handler=run_precompile)
