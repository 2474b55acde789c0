"""Work on a thread that a process's exit does not wait for."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["run_on_daemon"]

T = TypeVar("T")


def run_on_daemon(work: Callable[[], T], name: str) -> concurrent.futures.Future[T]:
    """`work()` on a daemon thread of its own, its result or exception in the returned future.
    Not a pool's thread: Python joins those at exit, and work that calls into a library with
    no time limit (NVRTC) must not hold a process's exit; whoever waits for the future gives
    its own limit."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as error:  # the waiter sees it, as from a pool
            future.set_exception(error)
    threading.Thread(target=run, name=name, daemon=True).start()
    return future
