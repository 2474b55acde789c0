"""Compilers' version lines, remembered in the cache so that a warm process runs none.

A compiler's version line (part of every cache key, jitk/build/toolchain.py) is kept in the
cache's FOLDER, beside the entries, under what the file it runs is: its path, and the
device, inode, size and times of what that names. A warm process's first load then starts no
compiler process (debugging_and_performance.md measures what that saves). A replaced or
upgraded compiler is another file, so it is asked again. A kept line is read only where the
user (and whom they trust: jitk/build/trust.py) alone could have written it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from jitk.base.errors import SettingError
from jitk.build import cache, trust

FOLDER = ".versions"


def _file(compiler: str) -> Path | None:
    try:
        status, root = os.stat(compiler), cache.cache_root().expanduser()
    except (OSError, SettingError):  # no such file, or a cache setting load_jit will refuse
        return None
    identity = "\0".join(map(str, (compiler, os.path.realpath(compiler), status.st_dev,
                                   status.st_ino, status.st_size, status.st_mtime_ns,
                                   status.st_ctime_ns)))
    return root / FOLDER / hashlib.sha256(identity.encode()).hexdigest()[:32]


def remembered(compiler: str) -> str | None:
    """The line kept for this compiler's file, if one is there that only the user (and
    whom they trust) could have written; else None."""
    path = _file(compiler)
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as kept:
        try:
            if trust.problem(os.fstat(kept.fileno())) or trust.problem(os.stat(path.parent)):
                return None
            line = kept.read(4097).decode(errors="replace").strip()
        except OSError:
            return None
    return line if line and len(line) <= 4096 and "\n" not in line else None


# Lines asked while the cache folder did not exist yet: a call refused before any build
# leaves no cache behind, so they are kept once a build or load has the folder.
_PENDING: dict[str, str] = {}


def remember(compiler: str, line: str) -> None:
    """Keeps `line` for the next process, written whole (a new file, then renamed), in a
    cache folder that exists (else pending: keep_pending); where the cache cannot be
    written, the next process asks again."""
    path = _file(compiler)
    if path is None:
        return
    if not path.parent.parent.is_dir():
        _PENDING[compiler] = line
        return
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        cache.make_folder(path.parent)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, trust.file_mode(0o644))
    except OSError:
        return
    try:  # the temporary is this process's own (O_EXCL made it): removed if unfinished
        with os.fdopen(fd, "w") as out:
            out.write(line + "\n")
        os.replace(temporary, path)
    except OSError:
        temporary.unlink(missing_ok=True)


def keep_pending() -> None:
    """Keeps the lines asked before the cache folder existed, now that a module was built
    into it or loaded from it."""
    pending = list(_PENDING.items())
    _PENDING.clear()
    for compiler, line in pending:  # pending again where the folder is still missing
        remember(compiler, line)
