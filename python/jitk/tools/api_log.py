"""Call logging for every jitk op: which kernel ran, with what (JITK_LOGLEVEL).

    JITK_LOGLEVEL=3 python serve.py          # every op call's arguments, before its launch

Levels: 0 (default) nothing, and the call path is untouched; 1 the op's name and how many
times it was called; 3 every argument (a tensor's shape, dtype, strides, device and data
pointer; scalars as they are) and what the op body notes about the kernel it chose; 5 adds
each tensor's min, max, mean and NaN and Inf counts, before the call for the inputs and after
it for what the call wrote (this synchronizes with the device); 10 adds a dump of the call's
tensors to JITK_DUMP_DIR, which `python -m jitk replay DUMP` runs again (the dumps and their
limits: jitk.tools.call_dumps).

A call's lines are written and flushed before the op runs, so the last lines of a crashed
process name the call that crashed it. Levels above 3 fall back to 3 inside CUDA graph
capture (statistics and copies cannot run there), with one notice; nothing is logged while
torch.compile traces. The settings are read when an op is defined; `reload()` applies
changed ones to every op.

An op body tells the log what it chose (instantiation, method, tuned configuration) with
`note()`, written below the call's arguments, before the launch:

    if api_log.noting:                      # free when logging is off
        api_log.note(kernel=f"RMSNorm<{hidden}, {dtype}>")
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import inspect
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TextIO

import torch

from jitk.base import settings as declared
from jitk.base.errors import SettingError
from jitk.runtime.op import add_call_wrapper, refresh_all
from jitk.tools.call_dumps import (
    DUMP_DIR_ENV,
    DUMP_EXCLUDE_ENV,
    DUMP_INCLUDE_ENV,
    DUMP_MAX_COUNT_ENV,
    DUMP_MAX_GB_ENV,
    Dumps,
    dtype_name,
    finish,
    has_data,
)

__all__ = ["note", "noting", "reload"]

LEVEL_ENV = "JITK_LOGLEVEL"
DEST_ENV = "JITK_LOGDEST"

LEVELS = (0, 1, 3, 5, 10)
ARGUMENTS, STATISTICS, DUMPS = 3, 5, 10
DEFAULT_DUMP_DIR = declared.SETTINGS[DUMP_DIR_ENV].default
DEFAULT_DUMP_MAX_GB = declared.SETTINGS[DUMP_MAX_GB_ENV].default
DEFAULT_DUMP_MAX_COUNT = declared.SETTINGS[DUMP_MAX_COUNT_ENV].default

# True while logging at level 3 or more is on: the time for an op body to note().
noting = False


@dataclasses.dataclass(frozen=True)
class Settings:
    level: int = 0
    dest: str = "stdout"
    dump_dir: Path = Path(DEFAULT_DUMP_DIR)
    dump_max_bytes: int = int(DEFAULT_DUMP_MAX_GB * 2**30)
    dump_max_count: int = DEFAULT_DUMP_MAX_COUNT
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()


def settings_from(environ: Mapping[str, str]) -> Settings:
    """The logging settings of an environment, each parsed by its rule in jitk.base.settings;
    a bad value raises SettingError (a ValueError) naming its variable."""
    def get(name: str) -> object:
        return declared.get(name, environ)

    level = int(get(LEVEL_ENV))
    if level >= DUMPS:
        try:
            import safetensors  # noqa: F401
        except ImportError:
            raise SettingError(f"{LEVEL_ENV}={level} dumps tensors as safetensors, which is "
                               "not installed: pip install safetensors (or jitk[fib])") from None
    return Settings(
        level=level, dest=get(DEST_ENV), dump_dir=Path(get(DUMP_DIR_ENV)),
        dump_max_bytes=int(get(DUMP_MAX_GB_ENV) * 2**30), dump_max_count=get(DUMP_MAX_COUNT_ENV),
        include=get(DUMP_INCLUDE_ENV), exclude=get(DUMP_EXCLUDE_ENV))


@functools.cache
def settings() -> Settings:
    return settings_from(os.environ)


# ---------------------------------------------------------------------------- the output
class _Output:
    """Where lines go: stdout and stderr are looked up at each write (so a redirection
    later in the program is followed); a path is opened once, for appending."""

    def __init__(self, dest: str) -> None:
        self.dest, self.file, self.lock = dest, None, threading.Lock()

    def stream(self) -> TextIO:
        if self.dest == "stdout":
            return sys.stdout
        if self.dest == "stderr":
            return sys.stderr
        if self.file is None:
            path = Path(self.dest.replace("%i", str(os.getpid())))
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - process-long
                atexit.register(self.file.close)  # closed at exit, not left to the collector
            except OSError as error:
                raise OSError(f"{DEST_ENV}={self.dest!r}: cannot open {path} for the jitk "
                              f"call log: {error.strerror}") from None
        return self.file

    def write(self, lines: list[str]) -> None:
        with self.lock:  # one call's lines stay together
            stream = self.stream()
            stream.write("".join(line + "\n" for line in lines))
            stream.flush()


@functools.cache
def _output(dest: str) -> _Output:
    return _Output(dest)


# ----------------------------------------------------------------------- the formatting
def describe_tensor(tensor: torch.Tensor) -> str:
    """'Tensor(shape=(4, 128), dtype=bfloat16, strides=(128, 1), device=cuda:0,
    data_ptr=0x7f00...)'; tensors without storage (fake, meta) say so instead of an address."""
    address = f"0x{tensor.data_ptr():x}" if has_data(tensor) else "none (no storage)"
    return (f"Tensor(shape={tuple(tensor.shape)}, dtype={dtype_name(tensor.dtype)}, "
            f"strides={tuple(tensor.stride())}, device={tensor.device}, data_ptr={address})")


def describe_value(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return describe_tensor(value)
    if isinstance(value, list | tuple):
        items = ", ".join(describe_value(v) for v in value)
        return f"[{items}]"
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    return f"{type(value).__name__} {value!r}"


def statistics(tensor: torch.Tensor) -> str:
    """min, max, mean and the NaN and Inf counts, computed in float64 (synchronizes)."""
    if not has_data(tensor):
        return "no data (a fake or meta tensor)"
    if tensor.numel() == 0:
        return "empty"
    values = tensor.detach().to(torch.float64)
    finite = values[torch.isfinite(values)]
    nan = int(torch.isnan(values).sum())
    inf = int(torch.isinf(values).sum())
    if finite.numel() == 0:
        return f"no finite values, nan={nan}, inf={inf}"
    return (f"min={finite.min().item():.6g}, max={finite.max().item():.6g}, "
            f"mean={finite.mean().item():.6g}, nan={nan}, inf={inf}")


def tensors_of(arguments: dict[str, object]) -> dict[str, torch.Tensor]:
    """name -> tensor for every tensor argument; a list's items are name.0, name.1, ..."""
    found = {}
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            found[name] = value
        elif isinstance(value, list | tuple):
            found.update({f"{name}.{i}": v for i, v in enumerate(value)
                          if isinstance(v, torch.Tensor)})
    return found


def returned_tensors(result: object) -> dict[str, torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return {"result": result}
    if isinstance(result, tuple):
        return {f"result.{i}": v for i, v in enumerate(result) if isinstance(v, torch.Tensor)}
    return {}


# ----------------------------------------------------------------------------- notes
_current = threading.local()  # .lines: the running logged call's output, on this thread


def note(**fields: object) -> None:
    """Tell the log what this op call chose, e.g. note(kernel="RMSNorm<4096, bf16_t>",
    method="copy_engine"). Written (and flushed) at once, below the call's arguments, when
    the running op call is logged at level 3 or more; otherwise nothing happens. Guard it
    with `if api_log.noting:` on a hot path, so the text is not even formatted."""
    output = getattr(_current, "output", None)
    if output is None or not fields:
        return
    output.write(["  note: " + ", ".join(f"{key}={value}" for key, value in fields.items())])


# ----------------------------------------------------------------------------- the wrapper
_capture_notice = threading.Event()
_CALL_COUNTS: dict[str, itertools.count] = {}  # op name -> its calls in this process


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class _LoggedCall:
    """An op's body with its calls logged at `config.level`."""

    def __init__(self, name: str, fn: Callable, signature: inspect.Signature,
                 mutated: tuple[str, ...], config: Settings, dumps: Dumps,
                 module: str | None = None) -> None:
        self.name, self.fn, self.signature, self.mutated = name, fn, signature, mutated
        # The op's count outlives this wrapper (a reload or reference mode makes another): a
        # call number, and so a dump folder's name, is never given twice in a process.
        self.config, self.dumps = config, dumps
        self.calls = _CALL_COUNTS.setdefault(name, itertools.count(1))
        self.output = _output(config.dest)
        self.module = module or getattr(fn, "__module__", None)
        functools.update_wrapper(self, fn)

    def __call__(self, *args: object, **kwargs: object) -> object:
        if torch.compiler.is_compiling():
            return self.fn(*args, **kwargs)
        number = next(self.calls)
        level = self.config.level
        header = f"[jitk pid {os.getpid()} {time.strftime('%H:%M:%S')}] {self.name} call {number}"
        if level < ARGUMENTS:
            self.output.write([header])
            return self.fn(*args, **kwargs)
        arguments = self.signature.bind(*args, **kwargs)
        arguments.apply_defaults()
        values = arguments.arguments
        lines = [header]
        if level > ARGUMENTS and _capturing():
            if not _capture_notice.is_set():
                _capture_notice.set()
                lines.append(f"  (CUDA graph capture: {LEVEL_ENV}={level} logs as level 3 "
                             "while capturing; said once)")
            level = ARGUMENTS
        if level >= STATISTICS:
            lines.append(f"  ({LEVEL_ENV}={level}: statistics synchronize the device)")
        tensors = tensors_of(values)
        for name, value in values.items():
            lines.append(f"  {name}: {describe_value(value)}")
            if level >= STATISTICS:
                lines += [f"    {key} stats: {statistics(t)}" for key, t in tensors.items()
                          if key == name or key.startswith(name + ".")]
        self.output.write(lines)
        dump = self.dumps.start(self.name, self.module, number, self.mutated, values, tensors,
                                self.output.write) if level >= DUMPS else None
        outer, _current.output = getattr(_current, "output", None), self.output
        try:
            result = self.fn(*args, **kwargs)
        except BaseException as error:
            if dump is not None:
                finish(dump, {}, error)
            raise
        finally:
            _current.output = outer  # an op called from another's body
        if level >= STATISTICS:
            written = {**{k: t for k, t in tensors.items() if k.split(".")[0] in self.mutated},
                       **returned_tensors(result)}
            self.output.write([f"  after {self.name} call {number}: {key} stats: "
                               f"{statistics(t)}" for key, t in written.items()])
            if dump is not None:
                finish(dump, written)
        return result

_DUMPS: dict[Settings, Dumps] = {}


def wrap(name: str, fn: Callable, signature: inspect.Signature, mutated: tuple[str, ...],
         config: Settings | None = None, module: str | None = None) -> Callable | None:
    """`fn` with its calls logged, or None when logging is off (level 0). `module` is the
    module that defines the op (what replay imports); default: fn's."""
    config = config or settings()
    if config.level == 0:
        return None
    dumps = _DUMPS.setdefault(config, Dumps(config))
    return _LoggedCall(name, fn, signature, mutated, config, dumps, module)


def call_wrapper(info, fn: Callable) -> Callable | None:
    """jitk.op's call wrapper (custom_op.add_call_wrapper): every op's calls logged."""
    global noting
    noting = settings().level >= ARGUMENTS
    return wrap(info.name, fn, info.signature, info.mutates_args,
                module=getattr(info.fn, "__module__", None))


def reload() -> None:
    """Read the JITK_LOGLEVEL, JITK_LOGDEST and JITK_DUMP_* settings again and apply them
    to every op; a bad value raises SettingError (a ValueError) naming its variable, and
    changes nothing."""
    global noting
    settings_from(os.environ)  # fails before anything changes
    settings.cache_clear()
    noting = settings().level >= ARGUMENTS
    refresh_all()


# Every op's calls go through the wrapper from the moment this module is imported (the
# package's __init__ and every shipped kernel family import it); at level 0 it leaves the
# slot alone.
add_call_wrapper(call_wrapper)
