"""The jitk command line: `python -m jitk [command]`.

  (no command)  write .clangd here, so clangd understands jitk kernels
  demo          run jitk's demo
  cache         list the module cache; `cache clear` empties it, `cache prune` trims it
  precompile    build the kernels' common configurations into the cache ahead of time
  env           what jitk runs with (versions, compilers, GPUs, cache, settings); --json

Exit codes: 0 success, 1 failure, 2 bad usage."""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import re
import sys
import time
from pathlib import Path

from . import cache, clangd, env, precompile, toolchain
from .lock import JitLockError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class CommandError(RuntimeError):
    """A failure to report in one line and exit 1."""


class UsageError(CommandError):
    """A command that cannot run as given: reported in one line, exit 2."""


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
        demo = importlib.import_module("jitk.demo")
    except ModuleNotFoundError as error:
        if error.name != "jitk.demo":
            raise
        message = "this jitk installation has no demo (jitk/demo.py is missing)"
        raise CommandError(message) from None
    return demo.main() or EXIT_OK


def show_env(args: argparse.Namespace) -> int:
    report = env.collect()
    print(json.dumps(report, indent=1) if args.json else env.render(report))
    return EXIT_OK


def human_size(size: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def human_age(seconds: float) -> str:
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= length:
            return f"{seconds / length:.0f} {unit}"
    return f"{seconds:.0f} s"


def print_entries(entries: list[cache.CacheEntry]) -> None:
    rows = [(e.module, ",".join(toolchain.sm_name(a) for a in e.archs) or "host",
             human_size(e.size_bytes), human_age(e.age_seconds), e.path.name) for e in entries]
    rows.insert(0, ("MODULE", "ARCH", "SIZE", "AGE", "FOLDER"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def list_cache(args: argparse.Namespace) -> int:
    entries = cache.list_entries()
    root = cache.cache_root()
    if not entries:
        print(f"no modules cached in {root}")
        return EXIT_OK
    print(f"{len(entries)} module(s) cached in {root}:")
    print_entries(entries)
    return EXIT_OK


def entries_word(count: int) -> str:
    return f"{count} cache entr{'y' if count == 1 else 'ies'}"


def report_removal(removed: int, failures: list[str]) -> int:
    print(f"removed {entries_word(removed)} from {cache.cache_root()}")
    if failures:
        lines = "\n  ".join(failures)
        raise CommandError(f"{len(failures)} item(s) could not be removed:\n  {lines}")
    return EXIT_OK


def clear_cache(args: argparse.Namespace) -> int:
    return report_removal(*cache.clear())


def prune_cache(args: argparse.Namespace) -> int:
    if args.older_than is None and args.keep is None and args.max_size is None:
        raise UsageError("cache prune needs --older-than, --keep or --max-size")
    entries = cache.list_entries()
    doomed = cache.select_for_pruning(entries, args.older_than, args.keep, args.max_size)
    left = sum(e.size_bytes for e in entries if e not in doomed)
    if doomed:
        print(f"{'would remove' if args.dry_run else 'removing'} {entries_word(len(doomed))} "
              f"({human_size(sum(e.size_bytes for e in doomed))}):")
        print_entries(doomed)
    if args.dry_run:
        print(f"dry run: nothing removed; {entries_word(len(entries) - len(doomed))} "
              f"({human_size(left)}) would stay")
        return EXIT_OK
    status = report_removal(*cache.prune(doomed))
    print(f"{entries_word(len(entries) - len(doomed))} ({human_size(left)}) left")
    return status


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


def selected_modules(chosen: list[str] | None) -> list[str]:
    registered = precompile.registered_modules()
    unknown = [name for name in chosen or () if name not in registered]
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
        built = sum(o.built for o in mine)
        print(f"{precompile.short_name(module)}: {sum(o.seconds for o in mine):.1f} s over "
              f"{len(mine)} configuration(s) ({built} built, {len(mine) - built} cached)")
    print(f"{len(outcomes)} configuration(s) in {wall:.1f} s with {jobs} job(s); "
          f"cache: {cache.cache_root()}")


def run_precompile(args: argparse.Namespace) -> int:
    labels, missing = precompile.config_labels(selected_modules(args.module))
    for name in missing:
        print(f"{name} is not installed; skipped", file=sys.stderr)
    if args.list:
        print_configs(labels)
        return EXIT_OK
    if not any(labels.values()):
        raise CommandError("no kernel configurations to precompile")
    archs = args.arch or default_precompile_archs()
    for arch in archs:
        try:
            toolchain.check_buildable(toolchain.parse_archs(arch))
        except toolchain.ToolchainError as error:
            raise UsageError(str(error)) from None
    tasks = precompile.make_tasks(labels, archs)
    jobs = args.jobs or os.cpu_count() or 1
    finished = itertools.count(1)

    def report(outcome: precompile.Outcome) -> None:
        result = (f"FAILED after {outcome.seconds:.1f} s" if outcome.error else
                  f"{outcome.seconds:.1f} s" + ("" if outcome.built else " (cached)"))
        print(f"[{next(finished)}/{len(tasks)}] {outcome.task.describe()}: {result}",
              flush=True)

    started = time.perf_counter()
    outcomes = precompile.run(tasks, jobs, report)
    print_summary(outcomes, time.perf_counter() - started, min(jobs, len(tasks)))
    failed = [o for o in outcomes if o.error]
    for outcome in failed:
        print(f"\nFAILED: {outcome.task.describe()}\n{outcome.error}", file=sys.stderr)
    if failed:
        names = ", ".join(o.task.describe() for o in failed)
        print(f"\njitk: {len(failed)} build(s) failed: {names}", file=sys.stderr)
    return EXIT_FAILURE if failed else EXIT_OK


def valid_arch(text: str) -> str:
    try:
        toolchain.parse_archs(text)
    except toolchain.ToolchainError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def non_negative_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of days >= 0, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_size(text: str) -> int:
    """'500M', '2G', '1.5GiB', '4096' -> bytes (units are powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"expected a size such as 500M or 2G, got {text!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jitk", usage="%(prog)s [-h] [--force] [COMMAND ...]",
        description="Without a command: write .clangd in the current directory, so that "
                    "clangd understands kernels that include <jitk/...> headers.",
        epilog="Exit codes: 0 success, 1 failure, 2 bad usage.")
    parser.add_argument("--force", action="store_true",
                        help="replace a .clangd that jitk did not write")
    parser.set_defaults(handler=write_clangd)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", prog=parser.prog)

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

    cache_parser = commands.add_parser(
        "cache", help="list the module cache (cache clear: empty it; cache prune: trim it)",
        usage="%(prog)s [-h] [clear | prune ...]",
        description="List the compiled modules in the cache ($JITK_CACHE_DIR, else "
                    "~/.cache/jitk), newest first.")
    cache_parser.set_defaults(handler=list_cache)
    cache_actions = cache_parser.add_subparsers(title="actions", metavar="ACTION",
                                              prog=cache_parser.prog)
    cache_actions.add_parser(
        "clear", help="remove every cached module",
        description="Remove every cached module. Safe beside running programs: builds in "
                    "progress are left alone, and a program whose module went builds it "
                    "again.").set_defaults(handler=clear_cache)
    prune = cache_actions.add_parser(
        "prune", help="remove old or surplus cached modules",
        description="Remove the entries that any of the options selects (age counts from "
                    "the build). Safe beside running programs, as clear is.")
    prune.add_argument("--older-than", type=non_negative_number, metavar="DAYS",
                       help="entries built more than DAYS days ago")
    prune.add_argument("--keep", type=non_negative_int, metavar="N",
                       help="all but the newest N entries of each module")
    prune.add_argument("--max-size", type=byte_size, metavar="SIZE",
                       help="the oldest entries, until the cache fits in SIZE (e.g. 2G)")
    prune.add_argument("--dry-run", action="store_true",
                       help="list what would be removed and remove nothing")
    prune.set_defaults(handler=prune_cache)

    build = commands.add_parser(
        "precompile", help="build the kernels' common configurations into the cache",
        description="Build every precompile_configs() entry of the kernel modules "
                    f"({', '.join(precompile.KERNEL_MODULES)} and those named in "
                    f"${precompile.MODULES_ENV}) into the cache, so that a later first call "
                    "only loads.")
    build.add_argument("--arch", action="append", type=valid_arch, metavar="ARCH",
                       help="a JITK_CUDA_ARCH value to build for, e.g. 9.0; repeat for "
                            f"more (default: ${toolchain.ARCH_ENV}, else the current GPU's)")
    build.add_argument("--jobs", "-j", type=positive_int, metavar="N",
                       help="builds at a time (default: the number of CPUs)")
    build.add_argument("--module", action="append", metavar="NAME",
                       help="only this kernel module; repeat for more (default: all)")
    build.add_argument("--list", action="store_true",
                       help="print the configurations and build nothing")
    build.set_defaults(handler=run_precompile)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.force and args.handler is not write_clangd:
        parser.error("--force only applies to writing .clangd (no command)")
    try:
        return args.handler(args)
    except UsageError as error:
        parser.exit(EXIT_USAGE, f"jitk: error: {error}\n")
    except (CommandError, precompile.PrecompileError, toolchain.ToolchainError,
            JitLockError) as error:
        print(f"jitk: error: {error}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
