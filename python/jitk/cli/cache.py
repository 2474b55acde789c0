"""`python -m jitk cache [clear | prune ...]`: list, empty or trim the module cache (the
remote cache's keygen, push and pull are in jitk/cli/remote.py)."""

from __future__ import annotations

import argparse
import re

from jitk.build import cache, pruning, toolchain
from jitk.cli import remote
from jitk.cli.common import EXIT_OK, CommandError, UsageError, valid_arch


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
             human_size(e.size_bytes), human_age(e.age_seconds),
             e.path.name + (f" (damaged: {e.problem})" if e.problem else "")) for e in entries]
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
    if foreign := cache.foreign_folders():
        print(f"left {len(foreign)} folder{'s' if len(foreign) > 1 else ''} jitk did not make: "
              f"{', '.join(f.name for f in foreign)}")
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
    doomed = pruning.select_for_pruning(entries, args.older_than, args.keep, args.max_size,
                                      args.arch)
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


def prune_target(text: str) -> tuple[str, ...]:
    """An --arch of prune: architectures as JITK_CUDA_ARCH writes them, or 'host'."""
    return () if text == "host" else toolchain.parse_archs(valid_arch(text))


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


def register(commands: argparse._SubParsersAction) -> None:
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
                    "the build). Without --arch, the newest entry of each module "
                    "configuration and architecture stays, so a cache filled for several GPUs "
                    "keeps serving each. Safe beside running programs, as clear is.")
    prune.add_argument("--older-than", type=non_negative_number, metavar="DAYS",
                       help="entries built more than DAYS days ago")
    prune.add_argument("--keep", type=non_negative_int, metavar="N",
                       help="all but the newest N entries of each module configuration "
                            "(name and template arguments) and architecture")
    prune.add_argument("--arch", action="append", type=prune_target, metavar="ARCH",
                       help="only entries built for ARCH (e.g. 9.0, or host), the last one "
                            "of a configuration included; repeat for more. Without it, the "
                            "newest entry of each configuration and architecture stays")
    prune.add_argument("--max-size", type=byte_size, metavar="SIZE",
                       help="the oldest entries, until the cache fits in SIZE (e.g. 2G)")
    prune.add_argument("--dry-run", action="store_true",
                       help="list what would be removed and remove nothing")
    prune.set_defaults(handler=prune_cache)
    remote.add_commands(cache_actions)
