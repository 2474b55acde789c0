"""`python -m jitk tune [OP ...]`: time the ops' launch choices on this GPU and record the
fastest in the tuning file (jitk/tools/autotune.py)."""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

from jitk.cli.common import (
    EXIT_OK,
    CommandError,
    UsageError,
    add_dtypes,
    add_jobs,
    default_precompile_archs,
    selected_ops,
)


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


def register(commands: argparse._SubParsersAction) -> None:
    tune = commands.add_parser(
        "tune", help="time the ops' launch choices on this GPU and record the fastest",
        description="Build every candidate of each op's tuning space for the shapes, check "
                    "each against the op's reference, time them under CUDA graph replay, and "
                    "record the fastest in the tuning file beside the cache.")
    tune.add_argument("op", nargs="*", help="op names (default: every op with a space)")
    tune.add_argument("--shapes", nargs="+", type=parse_shape, metavar="SHAPE",
                      help="shapes such as 16x4096 (default: each op's own list)")
    add_dtypes(tune, "torch dtype names (default: bfloat16)", default=["bfloat16"])
    tune.add_argument("--verbose", "-v", action="store_true",
                      help="print every candidate's time, not only the winner's")
    add_jobs(tune)
    tune.add_argument("--beside", action="store_true",
                      help="time each call after the kernel a model runs before the op (a "
                           "GEMM for the norms), less that kernel's own time, and try the "
                           "choices that matter only there (PDL off); ops without one are "
                           "left out")
    tune.add_argument("--export-table", type=Path, metavar="PATH",
                      help="then write the tuning file's entries of these ops for this GPU "
                           "and these versions to PATH, a table to ship with the package")
    tune.set_defaults(handler=run_tune)
