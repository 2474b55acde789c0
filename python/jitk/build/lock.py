"""The build lock of one cache entry: an flock on `<entry>.lock` beside the entry, or in
$JITK_LOCK_DIR when that is set (a host-local folder for a cache on a network file system,
whose locks may not reach other hosts: builds there may then run twice, and publication
stays atomic; jitk/build/cache.py). A build_directory's lock is in its own .jitk folder.

Only a build takes it; loading a finished entry takes no lock. An flock belongs to the
process holding it, so the kernel releases it when that process dies, however it dies: a
lock left by a killed build is never mistaken for a live one. The holder writes
"<pid> <host>" into the file, so that a process that waits too long can say who holds it.

Every wait is bounded: a lock that cannot be created fails at once, and one held longer
than $JITK_LOCK_TIMEOUT seconds (default 300) fails naming its holder."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from jitk.base import settings
from jitk.base.errors import JitkError
from jitk.build import trust

TIMEOUT_ENV = "JITK_LOCK_TIMEOUT"
LOCK_DIR_ENV = "JITK_LOCK_DIR"
DEFAULT_TIMEOUT = 300.0
SUFFIX = ".lock"
# Group members may build in a cache of the trusted group (jitk/build/trust.py); others only read.
MODE = 0o664


class JitLockError(JitkError, RuntimeError):
    """A build lock could not be created, or was held by another process for too long."""


def lock_timeout() -> float:
    """$JITK_LOCK_TIMEOUT in seconds: the longest jitk waits for a build, another process's
    or its own."""
    return settings.get(TIMEOUT_ENV)


def lock_folder(root: Path) -> Path:
    """Where the build locks of the cache at `root` are: $JITK_LOCK_DIR, else `root`."""
    folder = settings.get(LOCK_DIR_ENV)
    return Path(folder).expanduser() if folder else root


def lock_path(entry: Path) -> Path:
    """The build lock of a cache entry."""
    return lock_folder(entry.parent) / (entry.name + SUFFIX)


def entry_name(lock: Path) -> str | None:
    """The name of the entry whose lock_path is `lock` (None: not a name lock_path gives)."""
    return lock.name[:-len(SUFFIX)] if lock.name.endswith(SUFFIX) else None


def _open(path: Path) -> int:
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=trust.folder_mode())  # a new cache
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, MODE)
    except OSError as error:
        raise JitLockError(f"jitk: cannot create the build lock {path}: {error.strerror} "
                           f"(errno {error.errno}); building needs a writable cache (set "
                           f"JITK_CACHE_DIR), or fill this one where it is writable") from None


def _still_at(fd: int, path: Path) -> bool:
    """Whether `path` still names the file `fd` locked: a clear may have unlinked it, and
    a lock on an unlinked file excludes nobody."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def holder(path: Path) -> str:
    """Who holds (or last held) the lock, as its holder wrote it: 'pid 123 on host h'."""
    try:
        pid, host = path.read_text().split()[:2]
    except (OSError, ValueError):
        return "an unknown process"
    here = " (this machine)" if host == socket.gethostname() else ""
    return f"pid {pid} on {host}{here}"


def try_lock(path: Path) -> int | None:
    """The locked file descriptor, or None when another process holds the lock."""
    fd = _open(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError as error:
        os.close(fd)
        raise JitLockError(f"jitk: cannot lock {path}: {error.strerror}") from None
    if not _still_at(fd, path):
        os.close(fd)
        return try_lock(path)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    return fd


def release(fd: int) -> None:
    os.close(fd)  # closing the last descriptor drops the flock


@contextlib.contextmanager
def build_lock(path: Path, entry: Path, timeout: float | None = None) -> Iterator[None]:
    """Holds the build lock at `path`, of `entry`, for the body, waiting at most `timeout`
    seconds (default $JITK_LOCK_TIMEOUT) for another process to release it."""
    timeout = lock_timeout() if timeout is None else timeout
    deadline = time.monotonic() + timeout
    pause = 0.01
    while (fd := try_lock(path)) is None:
        if time.monotonic() > deadline:
            raise JitLockError(
                f"jitk waited {timeout:g} s for the build lock {path}, held by "
                f"{holder(path)}, which is still building {entry.name}; wait for it, stop "
                f"it, or raise {TIMEOUT_ENV}")
        time.sleep(pause)
        pause = min(pause * 2, 0.2)
    try:
        yield
    finally:
        release(fd)


def is_held(path: Path) -> bool:
    """Whether a live process holds the lock at `path` (an unlinked or missing one: no)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
