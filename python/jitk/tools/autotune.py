"""Launch choices per shape, timed on the live GPU and kept in a file beside the build cache.

A kernel module declares an op's TuningSpace (its knobs and their choices, how the op's
arguments map to a shape bucket, today's defaults, and how to build one choice) and calls
`space.lookup(bucket)` on its call path: a dict lookup, cached per bucket. What a lookup
finds, in order: a choice made in this process, the tuning file's entry for this GPU and
these versions, the entry of the table shipped with the package for this GPU (the space's
`tables`, written by `python -m jitk tune --export-table`), today's default. A choice the
space no longer allows (its knobs, values or `allowed`) is passed over with a warning.
Tuning happens only when asked: `python -m jitk tune`, `jitk.autotune.tune(...)`, or
JITK_AUTOTUNE=1 (a lookup that neither the file nor the table answers tunes then, on fresh
tensors shaped like the call's).

`tune` times every candidate on the GPU: CUDA graphs of CALLS_PER_GRAPH calls each, replayed
in turn, candidate after candidate, ROUNDS times, each round queued whole while the GPU
sleeps, so that the host's launches stay off the clock; each candidate's figure is its
median. Candidates within GRAPH_TIE of the fastest are a tie that single calls break: the
one whose larger ratio to the fastest, under graph replay or as a single call, is smallest.
Before a candidate may win, its results are checked against the op's reference
(jitk.testing). Beside a neighbour (`tune(..., beside=True)`, `python -m jitk tune
--beside`), each call runs after the kernel a model runs before the op (the space's
`neighbour`, a GEMM for the norms), and the neighbour's own time, taken in the same round,
is taken off: the choice is made where the op runs in a model rather than after itself,
and knobs whose cost shows only there (the space's `beside_knobs`, PDL) are tried too.

The file, $JITK_CACHE_DIR/autotune.json, is jitk.tools.tuning_store's: entries keyed by op,
bucket, and environment (GPU and versions), merged under a lock on every write; the tables
shipped with a family are read there too.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import statistics
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path

import torch

from jitk.base import settings
from jitk.runtime.op import OpInfo, find_op, op_info
from jitk.tools import tuning_store
from jitk.tools.testing import compare_with_reference, copied_arguments
from jitk.tools.timing import captured_graph, trimmed_mean

# Public here before the tuning file had a module of its own.
from jitk.tools.tuning_store import FILE_NAME as FILE_NAME
from jitk.tools.tuning_store import FORMAT as FORMAT
from jitk.tools.tuning_store import environment, tuning_file
from jitk.tools.tuning_store import export_table as export_table
from jitk.tools.tuning_store import record as record
from jitk.tools.tuning_store import table_name as table_name

__all__ = ["TuningSpace", "environment", "tune", "tuning_file"]

AUTOTUNE_ENV = "JITK_AUTOTUNE"
CALLS_PER_GRAPH, ROUNDS = 20, 7
# A round of runs is queued behind a GPU sleep of this many cycles a run (several times what
# the host takes to queue one), doubled up to MAX_SLEEP_DOUBLINGS times
# while the host turns out slower.
SLEEP_CYCLES_PER_RUN, MAX_SLEEP_DOUBLINGS = 100_000, 6
# Candidates within GRAPH_TIE of the fastest under graph replay are a tie, which single calls
# break: SINGLE_ROUNDS rounds, each call behind a GPU sleep of its own of SINGLE_PAUSE_CYCLES,
# as a call alone on the GPU, each a trimmed mean (timing.trimmed_mean says why not the
# median): RMSNorm candidates that graph replay here told apart were level under
# bench_rmsnorm_peers.py's graph replay, and differed as single calls. The winner gives up
# least in either mode: with the lowest single call alone winning, long RMSNorms kept choices
# slower under graph replay beyond the benchmark's noise for single calls faster only inside
# theirs (docs/developer_guide/debugging_and_performance.md, "Figures moved out of the code").
GRAPH_TIE, SINGLE_ROUNDS, SINGLE_PAUSE_CYCLES = 0.015, 31, 40_000
# Beside a neighbour, each figure is a difference of two timings: more rounds for its median.
BESIDE_ROUNDS = 15


# ---------------------------------------------------------------------------- the space
@dataclasses.dataclass(eq=False)
class TuningSpace:
    """An op's launch choices.

    knobs:   name -> the values to try (JSON values: int, bool, str).
    bucket:  a function of the op's arguments -> the shape bucket, a tuple of JSON values
             (e.g. (hidden, "bfloat16", rows rounded up to a power of two)).
    default: bucket -> today's knob values (a dict over every knob).
    build:   (bucket, knob values) -> a function of the op's arguments that runs them.
    use:     the same for what a lookup chose, where a call should build something other
             than what tuning builds (one choice's module rather than the candidates'
             shared one, quicker to build); default: build.
    allowed: (bucket, knob values) -> whether to try that combination (default: all).
    outputs: the op's parameters it only writes, poisoned before each candidate's check.
    calls:   a cache the op's body may keep by any exact key (e.g. (shape, dtype)) -> what
             lookup returned, so a call skips working out its bucket; emptied whenever a
             choice changes.
    sample:  (shape, dtype, device) -> (args, kwargs) of a call of that shape, or a list of
             them where a shape spans buckets (rmsnorm: out of place and in place), for
             `python -m jitk tune --shapes`; `shapes` are the ones it tunes by default.
    module_key: (bucket, knob values) -> what identifies the module `build` makes, so that
             `python -m jitk tune` builds each once (buckets, or ops, that share a module
             share a key); default: every (op, bucket, knob values) its own.
    neighbour: (the op's args, kwargs) -> a function that runs, on tensors of its own, the
             kernel a model runs before the op (a norm: a GEMM), for tuning beside it.
    beside_knobs: knobs kept at their default but when tuning beside the neighbour: their
             gain or cost shows only between different kernels (PDL). `allowed` sees them
             at their default.
    tables:  a folder of tuning tables shipped with the package, one a GPU (table_name):
             what a lookup uses for a bucket the tuning file has no entry for.
    """

    knobs: Mapping[str, Sequence]
    bucket: Callable[..., tuple]
    default: Callable[[tuple], dict]
    build: Callable[[tuple, dict], Callable]
    use: Callable[[tuple, dict], Callable] | None = None
    allowed: Callable[[tuple, dict], bool] = lambda bucket, config: True
    outputs: tuple[str, ...] = ()
    sample: Callable[[tuple, torch.dtype, torch.device], tuple | list] | None = None
    shapes: tuple[tuple[int, ...], ...] = ()
    module_key: Callable[[tuple, dict], Hashable] | None = None
    neighbour: Callable[..., Callable[[], object]] | None = None
    beside_knobs: tuple[str, ...] = ()
    tables: Path | None = None
    op: str = ""  # set by attach()
    calls: dict = dataclasses.field(default_factory=dict, repr=False)
    _chosen: dict = dataclasses.field(default_factory=dict, repr=False)
    _candidates: dict = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name in ("bucket", "default", "build", "allowed"):
            if not callable(getattr(self, name)):
                raise TypeError(f"TuningSpace: '{name}' must be a function")
        if not self.knobs or not all(isinstance(v, Sequence) and v for v in self.knobs.values()):
            raise ValueError("TuningSpace: knobs must map each knob's name to a non-empty "
                             f"sequence of values, got {dict(self.knobs)!r}")
        unknown = set(self.beside_knobs) - set(self.knobs)
        if unknown:
            raise ValueError(f"TuningSpace: beside_knobs names no knob: {sorted(unknown)}")
        if self.beside_knobs and self.neighbour is None:
            raise ValueError("TuningSpace: beside_knobs need a neighbour to be tuned beside")

    def attach(self, op: Callable | OpInfo | str) -> TuningSpace:
        """Records this space as the op's (OpInfo.tuning); returns self."""
        info = op_info(op, "autotune")
        self.op, info.tuning = info.name, self
        return self

    def candidates(self, bucket: tuple, beside: bool = False) -> list[dict]:
        """Every allowed combination of the knobs, today's default first; the beside_knobs
        at other values than their default only `beside` the neighbour. Worked out once a
        bucket: the product of RMSNorm's knobs is 3072 combinations, and `allowed` sees each."""
        found = self._candidates.get((bucket, beside))
        if found is None:
            default = self.default(bucket)
            at_default = {name: default[name] for name in self.beside_knobs}
            values = [(default[name],) if name in at_default and not beside else choices
                      for name, choices in self.knobs.items()]
            every = (dict(zip(self.knobs, combination))
                     for combination in itertools.product(*values))
            found = self._candidates[bucket, beside] = [default, *(
                c for c in every if c != default and self.allowed(bucket, {**c, **at_default}))]
        return [dict(c) for c in found]  # the caller's to keep or change

    def job_key(self, bucket: tuple, config: dict) -> Hashable:
        """Candidates with equal keys share what `build` makes (see module_key)."""
        if self.module_key is not None:
            return self.module_key(bucket, config)
        return (self.op, tuning_store.key(self.op, _jsonable(bucket)),
                json.dumps(config, sort_keys=True))

    def lookup(self, bucket: tuple) -> Callable:
        """The function for a bucket: what this process chose, else the file's, else the
        shipped table's, else the default; with JITK_AUTOTUNE=1, a bucket neither the file
        nor the table has is tuned at its first call."""
        chosen = self._chosen.get(bucket)
        if chosen is None:
            config = self._recorded_config(bucket)
            if config is None and autotune_requested() and torch.cuda.is_available():
                return self._tuned_at_first_call(bucket)
            use = self.use or self.build
            chosen = self._chosen[bucket] = use(bucket, config or self.default(bucket))
        return chosen

    def _recorded_config(self, bucket: tuple) -> dict | None:
        """The tuning file's choice for the bucket, else the shipped table's, if it is one
        this space allows (a file written by another jitk may name knobs or values this one
        lacks or no longer tries: passed over, with a warning)."""
        key = _jsonable(bucket)
        for source, config in (
                ("tuning file", tuning_store.STORE.config(self.op, key)),
                ("shipped table", None if self.tables is None else
                 tuning_store.table_configs(self.tables).get(tuning_store.key(self.op, key)))):
            if config is None:
                continue
            if self._allows(bucket, config):
                return config
            warnings.warn(f"jitk.autotune: the {source}'s choice for {self.op} at {key} "
                          f"({config!r}) is not in this jitk's space ({dict(self.knobs)!r}) "
                          "or not one it tries there; passed over", stacklevel=3)
        return None

    def _allows(self, bucket: tuple, config: object) -> bool:
        if not (isinstance(config, dict) and config.keys() == self.knobs.keys()
                and all(config[k] in v for k, v in self.knobs.items())):
            return False
        default = self.default(bucket)
        at_default = {name: default[name] for name in self.beside_knobs}
        return config == default or self.allowed(bucket, {**config, **at_default})

    def _tuned_at_first_call(self, bucket: tuple) -> Callable:
        def first_call(*args: object, **kwargs: object) -> object:
            if bucket not in self._chosen:  # tuned on copies: the caller's tensors stay
                copies = copied_arguments((args, kwargs))
                tune(self.op, *copies)
            return self._chosen[bucket](*args, **kwargs)

        return first_call

    def sample_calls(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> list:
        """The (args, kwargs) of each call `sample` makes of the shape."""
        calls = self.sample(shape, dtype, device)
        return calls if isinstance(calls, list) else [calls]

    def config(self, bucket: tuple) -> dict:
        """The knob values a lookup of `bucket` uses now (not tuning)."""
        return self._recorded_config(bucket) or self.default(bucket)

    def forget(self) -> None:
        """Drops the choices cached in this process (after the file changed)."""
        self._chosen.clear()
        self.calls.clear()

    def recorded(self) -> list[tuple[list, dict]]:
        """(bucket, knob values) of every entry the file holds for this op, whatever GPU or
        versions it was tuned on, then the shipped tables' for this GPU: what `precompile`
        builds."""
        shipped = [] if self.tables is None else tuning_store.table_entries(self.tables)
        return [(e["bucket"], e["config"]) for e in (*tuning_store.read(tuning_file())[0], *shipped)
                if e["op"] == self.op and isinstance(e["config"], dict)
                and e["config"].keys() == self.knobs.keys()]


def autotune_requested() -> bool:
    return settings.flag(AUTOTUNE_ENV)


def _jsonable(bucket: tuple) -> list:
    return [str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v for v in bucket]


# ---------------------------------------------------------------------------- tuning
def _build_candidate(op: str, bucket: tuple, config: dict) -> None:
    from jitk.runtime import registry

    for module in registry.kernel_modules():  # registers the shipped ops
        importlib.import_module(module)
    find_op(op).tuning.build(bucket, config)


def prebuild(jobs: list[tuple[str, tuple, dict]], arch: str, workers: int) -> None:
    """Builds each (op, bucket, knob values) into the cache in parallel worker processes,
    so that tuning only loads. Workers see no GPU and build for `arch`."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from jitk.tools.precompile import init_worker, workers_see_no_gpu

    workers = max(1, min(workers, len(jobs)))
    with workers_see_no_gpu(), ProcessPoolExecutor(
            max_workers=workers, mp_context=get_context("spawn"),
            initializer=init_worker, initargs=(arch, workers)) as pool:
        for future in [pool.submit(_build_candidate, *job) for job in jobs]:
            future.result()


@dataclasses.dataclass
class Result:
    """One tuned bucket: the winner, every candidate's median under graph replay (None:
    failed the reference check, with the reason in `failures`), and the single-call trimmed
    means of the candidates that tied under graph replay (empty when none did); `beside`:
    timed after the space's neighbour, its own time taken off."""

    op: str
    bucket: list
    config: dict
    us: float
    default_us: float
    timings: list[tuple[dict, float | None]]
    failures: dict[str, str]
    tie: list[tuple[dict, float]]
    beside: bool = False


def _time_rounds(runs: list[Callable[[], object]], per_run: int, rounds: int,
                 pause_cycles: int = 0) -> list[list[float]]:
    """us per call of each run (a graph's replay of `per_run` calls, or one call) in each
    round: the runs interleaved over `rounds`. The order rotates from round to round, so
    that no run always follows the same one; with `pause_cycles`, each run waits behind a GPU
    sleep of its own. A round is queued whole while the GPU sleeps; when the GPU woke before
    the host had queued it, the round is taken again behind a longer sleep. The events so
    time the device's work alone: a replay of 20 short calls runs faster than the host
    launches the next one."""
    samples: list[list[float]] = [[] for _ in runs]
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in runs]
    woke = torch.cuda.Event()
    sleep = SLEEP_CYCLES_PER_RUN * len(runs)
    for round_ in range(rounds):
        order = [(round_ + i) % len(runs) for i in range(len(runs))]
        for _ in range(MAX_SLEEP_DOUBLINGS + 1):
            torch.cuda._sleep(sleep)  # private but long-standing: torch's own tests use it
            woke.record()
            for i in order:
                if pause_cycles:
                    torch.cuda._sleep(pause_cycles)
                marks[i][0].record()
                runs[i]()
                marks[i][1].record()
            queued_in_time = not woke.query()
            marks[order[-1]][1].synchronize()
            if queued_in_time:
                break
            sleep *= 2
        else:
            raise RuntimeError(f"tune: the host did not queue {len(runs)} runs within a GPU "
                               f"sleep of {sleep // 2} cycles")
        for sample, (start, end) in zip(samples, marks):
            sample.append(start.elapsed_time(end) * 1e3 / per_run)
    return samples


def _time_less(runs: list[Callable[[], object]], alone: Callable[[], object] | None,
               per_run: int, rounds: int, pause_cycles: int = 0) -> list[list[float]]:
    """_time_rounds of `runs`; with `alone` (the neighbour by itself, run as they run it),
    each sample less its time in the same round."""
    if alone is None:
        return _time_rounds(runs, per_run, rounds, pause_cycles)
    *samples, neighbour = _time_rounds([*runs, alone], per_run, rounds, pause_cycles)
    return [[us - base for us, base in zip(sample, neighbour)] for sample in samples]


def _fastest(calls: list[Callable[[], object]], graph_us: list[float],
             neighbour: Callable[[], object] | None = None) -> tuple[int, dict]:
    """The index of the winner, and {index: single-call us} of the tie it broke (empty when
    one candidate was fastest under graph replay by more than GRAPH_TIE). `calls` run the
    neighbour first when there is one."""
    graph_min = min(graph_us)
    tie = [i for i, us in enumerate(graph_us) if us <= graph_min * (1 + GRAPH_TIE)]
    if len(tie) == 1:
        return tie[0], {}
    single_us = {i: trimmed_mean(sample) for i, sample in zip(tie, _time_less(
        [calls[i] for i in tie], neighbour, 1, SINGLE_ROUNDS, SINGLE_PAUSE_CYCLES))}
    single_min = min(single_us.values())
    if min(graph_min, single_min) <= 0:  # beside a neighbour, a difference: no ratio then
        return min(tie, key=lambda i: (single_us[i], graph_us[i])), single_us

    def cost(i: int) -> tuple:  # the larger ratio to the fastest, then graph replay's
        graph, single = graph_us[i] / graph_min, single_us[i] / single_min
        return max(graph, single), graph
    return min(tie, key=cost), single_us


def tune(op: Callable | OpInfo | str, args: tuple, kwargs: Mapping | None = None, *,
         save: bool = True, beside: bool = False, calls: int = CALLS_PER_GRAPH,
         rounds: int | None = None) -> Result:
    """Tunes the bucket of `op(*args, **kwargs)` on the GPU, with these arguments (an op
    that writes its arguments writes them repeatedly): every candidate is checked against
    the reference, then timed (`beside`: each call after the space's neighbour, whose own
    time is taken off); the fastest correct one is used from now on in this process and,
    with `save`, recorded in the tuning file."""

    info = op_info(op, "autotune")
    space = info.tuning
    if not isinstance(space, TuningSpace):
        raise ValueError(f"tune: {info.name} declares no tuning space")
    if beside and space.neighbour is None:
        raise ValueError(f"tune: {info.name}'s tuning space names no neighbour to be timed "
                         "beside (TuningSpace.neighbour)")
    if not torch.cuda.is_available():
        raise RuntimeError("tune: needs a CUDA GPU (none is visible)")
    kwargs = dict(kwargs or {})
    bucket = space.bucket(*args, **kwargs)
    candidates = space.candidates(bucket, beside)
    runs, failures = [], {}
    for config in candidates:
        fn = space.build(bucket, config)
        problem = compare_with_reference(info, fn, args, kwargs, space.outputs)
        if problem:
            failures[json.dumps(config, sort_keys=True)] = problem
        else:
            runs.append((config, fn))
    if not runs:
        raise RuntimeError(f"tune: no candidate of {info.name} at {bucket} matches its "
                           f"reference: {failures}")
    neighbour = space.neighbour(args, kwargs) if beside else None
    calls_of = [lambda fn=fn: fn(*args, **kwargs) for _, fn in runs]
    if neighbour is not None:
        calls_of = [lambda call=call: (neighbour(), call()) for call in calls_of]
    graphs = [captured_graph(call, calls) for call in calls_of]
    alone = captured_graph(neighbour, calls) if neighbour is not None else None
    times = [statistics.median(sample) for sample in _time_less(
        [graph.replay for graph in graphs], None if alone is None else alone.replay, calls,
        rounds or (BESIDE_ROUNDS if beside else ROUNDS))]
    del graphs, alone
    best, single_us = _fastest(calls_of, times, neighbour)
    default = json.dumps(candidates[0], sort_keys=True)
    timed = {json.dumps(c, sort_keys=True): t for (c, _), t in zip(runs, times)}
    result = Result(info.name, _jsonable(bucket), runs[best][0], times[best],
                    timed.get(default, float("nan")),
                    [(c, timed.get(json.dumps(c, sort_keys=True))) for c in candidates],
                    failures, [(runs[i][0], us) for i, us in single_us.items()], beside)
    space._chosen[bucket] = runs[best][1]
    space.calls.clear()
    if save:
        record([{"op": info.name, "bucket": result.bucket, "environment": environment(),
                 "config": result.config, "us": round(result.us, 4),
                 "default_us": round(result.default_us, 4), "beside": beside}])
    return result
