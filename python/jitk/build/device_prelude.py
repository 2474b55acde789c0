"""The device halves' prelude (jitk/device_prelude.cuh: jitk's device headers and CUDA's fp16
and bf16 types), precompiled by NVRTC once a process for each set of options (the target and
include folders among them), so that the device halves built after it load it instead of
parsing it again.

NVRTC's precompiled headers serve only the process that made them (they hold addresses in
its heap), so they live in a folder private to the process, which it removes when it exits.
A build starts the one it needs as it starts (`start`), beside its host compile, and takes it
when NVRTC's turn comes (`get`); a prelude whose headers changed since (their size or time)
is made again. Where none can be made, NVRTC parses the header: the same code, the old
speed."""

from __future__ import annotations

import atexit
import concurrent.futures
import itertools
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from jitk.base import settings
from jitk.base.daemon import run_on_daemon
from jitk.build import nvrtc

__all__ = ["Prelude", "get", "start"]

logger = logging.getLogger("jitk")


@dataclass(frozen=True)
class Prelude:
    file: Path  # what nvrtc.compile_cubin takes as its pch
    headers: tuple[str, ...]  # the files its making read
    stamps: tuple[tuple[int, int] | None, ...]  # each one's size and time then

    def current(self) -> bool:
        return _stamps(self.headers) == self.stamps


def _stamps(paths: tuple[str, ...]) -> tuple[tuple[int, int] | None, ...]:
    def stamp(path: str) -> tuple[int, int] | None:
        try:
            info = os.stat(path)
        except OSError:
            return None
        return info.st_size, info.st_mtime_ns
    return tuple(map(stamp, paths))


_lock = threading.Lock()
_made: dict[tuple[str, ...], concurrent.futures.Future] = {}  # options -> Prelude | None
_numbers = itertools.count()  # a new file each making: a build may still read the old one
_state: dict[str, object] = {}  # "folder", "owner" (its pid): made on first use


def _forget() -> None:  # a forked child makes its own (its parent removes the folder)
    global _lock
    _lock = threading.Lock()
    _made.clear()
    _state.clear()


os.register_at_fork(after_in_child=_forget)


def _remove_folder() -> None:
    if _state.get("owner") == os.getpid():  # made by this process (mkdtemp), so its own
        shutil.rmtree(str(_state["folder"]), ignore_errors=True)


def _making(options: list[str]) -> concurrent.futures.Future:
    """_make(options) on a thread of its own. A daemon: NVRTC's call has no time limit, and
    a process's exit must not wait for one that never ends (a build waits for it no longer
    than its timeout, in `get`)."""
    if "folder" not in _state:
        _state["folder"] = Path(tempfile.mkdtemp(prefix="jitk-device-prelude-"))
        _state["owner"] = os.getpid()
        atexit.register(_remove_folder)
    return run_on_daemon(lambda: _make(options), "jitk-device-prelude")


def start(options: list[str]) -> None:
    """Begins making the prelude for NVRTC compiles with `options` on a thread, unless this
    process has it (or is making it) and its headers are unchanged. Nothing under
    JITK_DEVICE_PRELUDE=0."""
    if not settings.flag("JITK_DEVICE_PRELUDE"):
        return
    key = tuple(options)
    with _lock:
        future = _made.get(key)
        # Being made, made and current, or not to be made (tried once a process): kept.
        if future is not None and not _stale(future):
            return
        try:
            _made[key] = _making(list(options))
        except OSError as error:  # no private folder (the temporary folder is not writable)
            logger.info("jitk: no device prelude (%s); NVRTC parses it in every build", error)
            _made[key] = concurrent.futures.Future()
            _made[key].set_result(None)


def _stale(future: concurrent.futures.Future) -> bool:
    """Whether a making is done and made a prelude whose headers have changed since."""
    if not future.done() or future.exception() is not None:
        return False
    prelude = future.result()
    return prelude is not None and not prelude.current()


def get(options: list[str], timeout: float) -> Prelude | None:
    """The prelude for `options`, waiting at most `timeout` seconds for its making; None
    where it cannot be made or used (NVRTC then parses the header), and under
    JITK_DEVICE_PRELUDE=0."""
    if not settings.flag("JITK_DEVICE_PRELUDE"):
        return None
    start(options)
    with _lock:
        future = _made.get(tuple(options))
    if future is None:
        return None
    try:
        prelude = future.result(timeout)
    except concurrent.futures.TimeoutError:
        logger.info("jitk: NVRTC took over %g s to precompile the device prelude; building "
                    "without it", timeout)
        return None
    return prelude if prelude and prelude.current() else None


def _make(options: list[str]) -> Prelude | None:
    path = Path(str(_state["folder"])) / f"device_prelude.{next(_numbers)}.pch"
    try:
        headers = nvrtc.create_pch(path, nvrtc.PRELUDE, options)
    except (nvrtc.NvrtcError, OSError) as error:
        logger.info("jitk: no device prelude (%s); NVRTC parses it in every build", error)
        return None
    return Prelude(path, headers, _stamps(headers))
