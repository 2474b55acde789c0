"""Filling the module cache ahead of time with the kernels' common configurations.

Each kernel module defines `precompile_configs() -> [(label, thunk), ...]`, where a thunk
calls the module's cached loader for one configuration (jitk/runtime/registry.py finds jitk's own
modules). Here every thunk runs once per target architecture, in a pool of worker
processes, so that a later first call in a new process only loads from the cache. A
recorded load_jit call (`--call`, which a cache miss's message prints) is replayed the same
way, to build exactly the entry that was missed. Whether a
thunk built anything is what load_jit counted (jit.build_count()), not what it logged."""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from types import ModuleType

from jitk.base import settings
from jitk.base.errors import JitkError

# The kernel modules shipped with jitk, as they declare themselves.
from jitk.build import toolchain
from jitk.runtime import registry

KERNEL_MODULES = tuple(registry.kernel_modules())
# More modules with precompile_configs(), e.g. a project's own kernels: "pkg.a,pkg.b".
MODULES_ENV = "JITK_PRECOMPILE_MODULES"


class PrecompileError(JitkError, RuntimeError):
    """A kernel module could not be imported or has no precompile_configs()."""


# load_jit's keyword parameters, which a recorded call may give (tests/test_cli.py pins them).
CALL_PARAMETERS = ("cpp_files", "cuda_files", "cpp_wrappers", "cuda_wrappers", "extra_cflags",
                   "extra_cuda_cflags", "extra_ldflags", "extra_include_paths",
                   "build_directory", "min_arch", "cuda_compiler", "host_units")
CALL_MODULE = "load_jit"  # what a task that replays a recorded call is listed under


@dataclass(frozen=True)
class Task:
    module: str
    index: int
    label: str
    arch: str  # a JITK_CUDA_ARCH value: one architecture, or several for one fat library
    call: str | None = None  # a recorded load_jit call (JSON) to replay instead of a thunk

    def describe(self) -> str:
        archs = "+".join(toolchain.sm_name(a) for a in toolchain.parse_archs(self.arch)) \
            if self.arch else "host"
        return f"{short_name(self.module)} {self.label} ({archs})"


@dataclass(frozen=True)
class Outcome:
    task: Task
    seconds: float
    built: bool  # False when the thunk found its module already in the cache
    error: str | None = None


class Progress:
    """A `report` for run(): one line per finished task, as it finishes, with its seconds
    and how many tasks are left."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0

    def __call__(self, outcome: Outcome) -> None:
        self.done += 1
        result = (f"FAILED after {outcome.seconds:.1f} s" if outcome.error else
                  f"{outcome.seconds:.1f} s" + ("" if outcome.built else " (cached)"))
        print(f"[{self.done}/{self.total}] {outcome.task.describe()}: {result}; "
              f"{self.total - self.done} left", flush=True)


def short_name(module: str) -> str:
    return registry.family_of(module)


def module_named(name: str) -> str:
    """A module as a command line may name it: a shipped family by its short name ("norm"),
    by its module ("jitk.kernels.norm") or by its module before the kernels had a floor of
    their own ("jitk.norm"); any other module as it is."""
    family = name.removeprefix("jitk.")
    return registry.module_of(family) if family in registry.FAMILIES else name


def registered_modules() -> list[str]:
    """KERNEL_MODULES, then those named in $JITK_PRECOMPILE_MODULES."""
    extra = [name for name in settings.get(MODULES_ENV) if name]
    return list(dict.fromkeys([*KERNEL_MODULES, *extra]))


def import_kernel_module(name: str) -> ModuleType | None:
    """The module, or None for a shipped kernel module that is not installed."""
    try:
        return importlib.import_module(name)
    except Exception as error:  # any failure here is the module's, reported by its name
        not_installed = isinstance(error, ModuleNotFoundError) and error.name == name
        if not_installed and name in KERNEL_MODULES:
            return None
        raise PrecompileError(f"cannot import kernel module {name}: "
                              f"{type(error).__name__}: {error}") from error


def config_labels(modules: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """The labels of each present module's configurations, and the modules not installed."""
    labels, missing = {}, []
    for name in modules:
        module = import_kernel_module(name)
        if module is None:
            missing.append(name)
            continue
        if not callable(getattr(module, "precompile_configs", None)):
            raise PrecompileError(f"kernel module {name} has no precompile_configs()")
        labels[name] = [label for label, _ in checked_configs(name, module)]
    return labels, missing


def checked_configs(name: str, module: ModuleType) -> list[tuple[str, Callable[[], object]]]:
    """The module's precompile_configs(), or a PrecompileError that says what is wrong."""
    try:
        configs = module.precompile_configs()
    except Exception as error:
        raise PrecompileError(f"{name}.precompile_configs() raised {type(error).__name__}: "
                              f"{error}") from error
    rule = "a list of (label: str, thunk: callable) pairs"
    if not isinstance(configs, list | tuple):
        raise PrecompileError(f"{name}.precompile_configs() must return {rule}, got "
                              f"{type(configs).__name__} {configs!r:.60}")
    for i, config in enumerate(configs):
        if not (isinstance(config, tuple | list) and len(config) == 2
                and isinstance(config[0], str) and callable(config[1])):
            raise PrecompileError(f"{name}.precompile_configs() must return {rule}; item {i} "
                                  f"is {config!r:.60}")
    return list(configs)


def make_tasks(labels: dict[str, list[str]], archs: list[str]) -> list[Task]:
    return [Task(module, index, label, arch)
            for arch in archs
            for module, module_labels in labels.items()
            for index, label in enumerate(module_labels)]


def read_call(text: str) -> dict:
    """A recorded call, checked for its form (load_jit checks the values themselves)."""
    rule = ('a JSON object {"name_parts": [...], ...} with load_jit\'s keyword arguments, as '
            "a cache miss's message prints it")
    try:
        call = json.loads(text)
    except ValueError as error:
        raise ValueError(f"--call takes {rule}; it is not JSON ({error})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name_parts"), list):
        raise ValueError(f"--call takes {rule}; got {text!r:.80}")
    if unknown := sorted(set(call) - {"name_parts", *CALL_PARAMETERS}):
        raise ValueError(f"--call: {', '.join(unknown)} is not a load_jit argument; expected "
                         f"name_parts and any of {', '.join(CALL_PARAMETERS)}")
    return call


def call_tasks(calls: list[str], archs: list[str]) -> list[Task]:
    """One task per recorded call and architecture (none given: host code only)."""
    tasks = []
    for index, text in enumerate(calls):
        label = " ".join(map(str, read_call(text)["name_parts"]))
        tasks += [Task(CALL_MODULE, index, label, arch, text) for arch in archs or [""]]
    return tasks


def is_cuda_call(text: str) -> bool:
    call = read_call(text)
    return bool(call.get("cuda_files") or call.get("cuda_wrappers"))


def _replay(text: str) -> object:
    from jitk.build.jit import load_jit

    call = read_call(text)
    return load_jit(*call.pop("name_parts"), **call)


def init_worker(arch: str, workers: int) -> None:
    from jitk.build import cpus

    if arch:  # "" builds host code only
        os.environ[toolchain.ARCH_ENV] = arch
    os.environ.pop("JITK_DISABLE_JIT", None)  # precompiling is building, asked for by name
    cpus.share_cpus(workers)


@contextlib.contextmanager
def workers_see_no_gpu() -> Iterator[None]:
    """Workers only build. With no GPU visible, load_jit skips its check that the library
    runs on this machine's GPU, so code for other architectures can be built too. It must
    be in the environment the workers start with: once CUDA is initialised, hiding devices
    makes torch and the CUDA runtime disagree on how many there are. The GPU this process
    sees is named to them (JITK_TUNED_FOR), so that they list the configurations its shipped
    tuning tables add, as this process did."""
    from jitk.tools.tuning_store import TUNED_FOR_ENV, table_gpu  # torch: only when building

    saved = {name: os.environ.get(name) for name in ("CUDA_VISIBLE_DEVICES", TUNED_FOR_ENV)}
    gpu = table_gpu()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if gpu is not None:
        os.environ[TUNED_FOR_ENV] = f"{gpu[0]},{gpu[1]}"
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _run_in_worker(task: Task) -> tuple[float, bool, str | None]:
    """Runs one task; returns its seconds, whether it built, and its error if any."""
    from jitk.build.jit import build_count

    started = time.perf_counter()
    builds_before = build_count()
    try:
        if task.call is not None:
            _replay(task.call)
        else:
            configs = importlib.import_module(task.module).precompile_configs()
            label, thunk = configs[task.index] if task.index < len(configs) else (None, None)
            if label != task.label:  # the worker must list what this process listed
                raise PrecompileError(f"{task.module}.precompile_configs() lists {len(configs)} "
                                      f"configuration(s) in a worker, item {task.index} "
                                      f"{label!r}, where this process listed {task.label!r}")
            thunk()
        error = None
    except Exception as failure:  # reported with the task's name, not raised
        error = f"{type(failure).__name__}: {failure}"
    return time.perf_counter() - started, build_count() > builds_before, error


def run(tasks: list[Task], jobs: int, report: Callable[[Outcome], None]) -> list[Outcome]:
    """Runs every task, `jobs` at a time, calling `report` as each one finishes.

    One pool per architecture, since a worker's loaders cache their modules: a worker
    that built a configuration for one architecture would return it for another. Workers
    are spawned, not forked, so that none inherits a CUDA context from this process."""
    from jitk.build import builder  # tvm-ffi, and with it torch: only when building

    outcomes = []
    context = multiprocessing.get_context("spawn")
    for arch in dict.fromkeys(task.arch for task in tasks):
        group = [task for task in tasks if task.arch == arch]
        if arch and len(group) > 1:  # every build reads the host prelude, none goes without
            builder.build_prelude(toolchain.canonical_archs(toolchain.parse_archs(arch)))
        workers = min(jobs, len(group))
        with workers_see_no_gpu(), ProcessPoolExecutor(
                max_workers=workers, mp_context=context,
                initializer=init_worker, initargs=(arch, workers)) as pool:
            futures = {pool.submit(_run_in_worker, task): task
                       for task in group}
            for future in as_completed(futures):
                try:
                    outcome = Outcome(futures[future], *future.result())
                except Exception as crash:  # the worker died, e.g. killed for memory
                    outcome = Outcome(futures[future], 0.0, False, f"worker failed: {crash}")
                outcomes.append(outcome)
                report(outcome)
    return outcomes
