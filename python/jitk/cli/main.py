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

Exit codes: 0 success, 1 failure, 2 bad usage."""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import re
import sys
import time
import warnings
from pathlib import Path

from jitk.base import NUMPY_WARNING
from jitk.base.errors import PREFIX, JitkError
from jitk.build import cache, clangd, pruning, toolchain
from jitk.build.lock import JitLockError
from jitk.build.signing import RemoteCacheError
from jitk.cli import remote as remote_commands
from jitk.tools import env, precompile

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

warnings.filterwarnings("ignore", NUMPY_WARNING, UserWarning)  # see jitk/__init__.py


class CommandError(JitkError, RuntimeError):
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


def parse_shape(text: str) -> tuple[int, ...]:
    dims = text.lower().split("x")
    if not all(dim.isdigit() and int(dim) > 0 for dim in dims):
        raise argparse.ArgumentTypeError(f"expected a shape such as 16x4096, got {text!r}")
    return tuple(int(dim) for dim in dims)


def run_tune(args: argparse.Namespace) -> int:
    import torch

    from jitk.tools import autotune

    dtypes = {name: getattr(torch, name, None) for name in args.dtype}
    for name, dtype in dtypes.items():
        if not isinstance(dtype, torch.dtype):
            raise UsageError(f"--dtype: no torch dtype named {name!r}")
    ops = [info for info in selected_ops(args.op) if info.tuning is not None]
    if not ops:
        raise UsageError("none of the selected ops declares a tuning space")
    if args.beside:
        alone = [info.name for info in ops if info.tuning.neighbour is None]
        if args.op and alone:
            raise UsageError("--beside: no neighbour kernel to be timed beside "
                             f"(TuningSpace.neighbour) for {', '.join(alone)}")
        ops = [info for info in ops if info.tuning.neighbour is not None]
    if not torch.cuda.is_available():
        raise CommandError("tune times kernels on a GPU, and none is visible")
    calls = {}  # one call a bucket: a transfer's bucket, say, is the same in every dtype
    for info in ops:
        for name, dtype in dtypes.items():
            for shape in args.shapes or info.tuning.shapes:
                for call in info.tuning.sample_calls(shape, dtype, torch.device("cuda")):
                    bucket = info.tuning.bucket(*call[0], **call[1])
                    calls.setdefault((info.name, repr(bucket)), (info, call, shape, name))
    calls = list(calls.values())
    started = time.perf_counter()
    jobs, choices = {}, collections.Counter()
    for info, (call_args, kwargs), _, _ in calls:
        bucket = info.tuning.bucket(*call_args, **kwargs)
        for config in info.tuning.candidates(bucket, args.beside):
            key = info.tuning.job_key(bucket, config)
            jobs.setdefault(key, (info.name, bucket, config))
            choices[key] += 1
    # A module that holds more choices builds for longer: started first, it does not finish
    # last (RMSNorm's candidate modules take several times as long as its defaults').
    autotune.prebuild([jobs[key] for key in sorted(jobs, key=lambda key: -choices[key])],
                      default_precompile_archs()[0], args.jobs or os.cpu_count() or 1)
    built = time.perf_counter()
    print(f"built {len(jobs)} candidate(s) in {built - started:.1f} s")
    for info, (call_args, kwargs), shape, name in calls:
        result = autotune.tune(info, call_args, kwargs, beside=args.beside)
        default = info.tuning.default(info.tuning.bucket(*call_args, **kwargs))
        print(f"{info.name} {'x'.join(map(str, shape))} {name} {json.dumps(result.bucket)}: "
              f"{result.us:.2f} us "
              f"(default {result.default_us:.2f}) {_changes(result.config, default)}"
              + (f"; {len(result.failures)} failed the reference" if result.failures else "")
              + (f"; single calls broke a tie of {len(result.tie)}" if result.tie else "")
              + ("; beside its neighbour" if result.beside else ""),
              flush=True)
        if args.verbose:
            for config, us in result.timings:
                print(f"    {'failed' if us is None else f'{us:.3f}'}  "
                      f"{_changes(config, default)}")
            for config, us in result.tie:
                print(f"    single {us:.3f}  {_changes(config, default)}")
    print(f"tuned {len(calls)} shape(s) in {time.perf_counter() - built:.1f} s; recorded in "
          f"{autotune.tuning_file()}")
    if args.export_table:
        count = autotune.export_table([info.name for info in ops], args.export_table)
        print(f"exported {count} entries for this GPU to {args.export_table} (ship it as "
              f"{autotune.table_name(autotune.environment()['gpu'])} in the op's tables)")
    return EXIT_OK


def _changes(config: dict, default: dict) -> str:
    """A tuning choice as its differences from the default ("default" when none)."""
    changed = {name: value for name, value in config.items() if default.get(name) != value}
    return " ".join(f"{name}={value}" for name, value in changed.items()) or "default"


def valid_arch(text: str) -> str:
    try:
        toolchain.parse_archs(text)
    except toolchain.ToolchainError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def recorded_call(text: str) -> str:
    try:
        precompile.read_call(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def prune_target(text: str) -> tuple[str, ...]:
    """An --arch of prune: architectures as JITK_CUDA_ARCH writes them, or 'host'."""
    return () if text == "host" else toolchain.parse_archs(valid_arch(text))


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
    remote_commands.add_commands(cache_actions)

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
    build.add_argument("--call", action="append", type=recorded_call, metavar="JSON",
                       help="build exactly the entry of this load_jit call, as a cache miss's "
                            "message records it; repeat for more")
    build.set_defaults(handler=run_precompile)

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
    export.add_argument("--dtype", nargs="+", metavar="DTYPE",
                        help="dtypes of bfloat16 (default, the dataset's), float16, "
                             "float32")
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

    tune = commands.add_parser(
        "tune", help="time the ops' launch choices on this GPU and record the fastest",
        description="Build every candidate of each op's tuning space for the shapes, check "
                    "each against the op's reference, time them under CUDA graph replay, and "
                    "record the fastest in the tuning file beside the cache.")
    tune.add_argument("op", nargs="*", help="op names (default: every op with a space)")
    tune.add_argument("--shapes", nargs="+", type=parse_shape, metavar="SHAPE",
                      help="shapes such as 16x4096 (default: each op's own list)")
    tune.add_argument("--dtype", nargs="+", default=["bfloat16"], metavar="DTYPE",
                      help="torch dtype names (default: bfloat16)")
    tune.add_argument("--verbose", "-v", action="store_true",
                      help="print every candidate's time, not only the winner's")
    tune.add_argument("--jobs", "-j", type=positive_int, metavar="N",
                      help="builds at a time (default: the number of CPUs)")
    tune.add_argument("--beside", action="store_true",
                      help="time each call after the kernel a model runs before the op (a "
                           "GEMM for the norms), less that kernel's own time, and try the "
                           "choices that matter only there (PDL off); ops without one are "
                           "left out")
    tune.add_argument("--export-table", type=Path, metavar="PATH",
                      help="then write the tuning file's entries of these ops for this GPU "
                           "and these versions to PATH, a table to ship with the package")
    tune.set_defaults(handler=run_tune)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.force and args.handler is not write_clangd:
        parser.error("--force only applies to writing .clangd (no command)")
    try:
        return args.handler(args)
    except UsageError as error:
        parser.exit(EXIT_USAGE, f"jitk: error: {_said(error)}\n")
    except (CommandError, precompile.PrecompileError, toolchain.ToolchainError,
            JitLockError, RemoteCacheError, ValueError) as error:  # ValueError: a bad setting
        print(f"jitk: error: {_said(error)}", file=sys.stderr)
        return EXIT_FAILURE


def _said(error: Exception) -> str:
    """An error's message without the "jitk: " every jitk error starts with (the command
    line writes its own)."""
    return str(error).removeprefix(PREFIX)


if __name__ == "__main__":
    sys.exit(main())
