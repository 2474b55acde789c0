"""The on-disk module cache: where it is, how an entry is published and checked, what is in it.

    <root>/<module>_<key>/            a published entry; never changed once published
    <root>/<module>_<key>.lock        its build lock (jitk/build/lock.py), or in $JITK_LOCK_DIR
    <root>/.staging/<entry>.<owner>   a finished build being published, private to its builder
    <root>/.trash/<entry>.<owner>     an entry on its way out

(<owner> is "<host>-<pid>-<n>"; jitk/build/names.py: clear and prune remove only what these
names and an entry's record prove jitk made.) A build runs in a folder on its own host
(jitk/build/staging.py), is copied into a private folder on the cache's file system, loaded
from there and becomes the entry in one rename, with jitk-meta.json written last: rename
within one file system is atomic on a local and a network file system alike, so a reader
finds a whole entry or none. A build that finds an entry already published (another host
built it meanwhile) discards its copy. Reading takes no lock and writes nothing: the entry
is checked (who may have written it, the library against the digest taken when it was
built, the builder's own headers against theirs) and its library loaded from the descriptor
that was hashed. An entry is removed by renaming it into .trash first, so a reader never
sees half of one.

A build_directory given to load_jit is an entry of its own, jitk's only if jitk made it: its
lock and private copies live in its .jitk folder, and a new build replaces its files, with
the record removed first and written last."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from jitk.base import settings
from jitk.base.errors import JitkError, SettingError
from jitk.build import trust
from jitk.build.lock import SUFFIX as LOCK_SUFFIX
from jitk.build.lock import JitLockError, entry_name, lock_folder, lock_path, release, try_lock
from jitk.build.names import (
    ENTRY_NAME,
    META_FILE,
    abandoned,
    is_entry_name,
    is_private_name,
    private_name,
    record_problem,
)

logger = logging.getLogger("jitk")

CACHE_ENV = "JITK_CACHE_DIR"
FORMAT = 3  # of an entry; part of every cache key (3: headers recorded, not keyed)
STAGING_DIR = ".staging"
TRASH_DIR = ".trash"
OWN_DIR = ".jitk"  # a build_directory's lock and private copies
PACKAGE_DIR = Path(__file__).resolve().parent.parent  # jitk/, the package
# Stands for PACKAGE_DIR in keys and recorded paths, so that a cache filled by one
# installation of jitk is hit by another one of the same version elsewhere.
PACKAGE_MARK = "<jitk>"


class CacheWriteError(JitkError, OSError):
    """A finished build could not be copied into the cache (a full disk, a lost mount)."""


def cache_root() -> Path:
    """$JITK_CACHE_DIR, else ~/.cache/jitk: a folder, made when first built into."""
    return folder_setting(CACHE_ENV, settings.get(CACHE_ENV))


def folder_setting(variable: str, value: str) -> Path:
    """The folder a JITK_* setting names; SettingError when it names a file."""
    folder = Path(value).expanduser()
    if folder.exists() and not folder.is_dir():
        raise SettingError(f"{variable}={str(folder)!r} is a file; it must name a folder "
                           "(jitk makes it if it is missing)")
    return folder


def portable(path: Path | str) -> str:
    """A path with the package's location replaced by PACKAGE_MARK."""
    text = str(path)
    return text.replace(str(PACKAGE_DIR), PACKAGE_MARK, 1) if text.startswith(
        str(PACKAGE_DIR) + os.sep) else text


def local(recorded: str) -> Path:
    """The inverse of portable() for this installation."""
    return Path(recorded.replace(PACKAGE_MARK, str(PACKAGE_DIR), 1))


def digest(path: Path) -> str:
    return digest_bytes(path.read_bytes())


def digest_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest_fd(fd: int) -> str:
    hashed, offset = hashlib.sha256(), 0
    while chunk := os.pread(fd, 1 << 20, offset):
        hashed.update(chunk)
        offset += len(chunk)
    return hashed.hexdigest()


def read_meta(entry: Path) -> dict | None:
    """The entry's record, or None when there is no (readable) entry."""
    try:
        meta = json.loads((entry / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


@dataclass(frozen=True)
class Lookup:
    """What a reader found: a checked library, open at `fd` (jitk/build/loader.py takes it over),
    or why there is none to load (`problem` is None when there is simply no entry)."""

    library: Path | None = None
    fd: int | None = None
    problem: str | None = None
    device_code: dict[str, bytes] = field(default_factory=dict)  # file name -> checked bytes


def _open_in_entry(entry: Path, name: object) -> tuple[int | None, str | None]:
    """The descriptor of the file a record names inside the entry, or why it cannot be used
    (both None: the entry went)."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
        return None, f"its {META_FILE} names {name!r}, not a file in the entry"
    try:
        return os.open(entry / name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW), None
    except FileNotFoundError:
        return None, (f"{entry / name} is missing" if entry.is_dir() else None)
    except OSError as error:
        if error.errno == errno.ELOOP:
            return None, f"{entry / name} is a symbolic link"
        return None, f"{entry / name} cannot be read: {error.strerror}"


def _headers_problem(meta: dict) -> str | None:
    for recorded, expected in meta.get("headers", {}).items():
        try:
            if digest(local(recorded)) != expected:
                return f"{local(recorded)} changed since it was built"
        except OSError as error:
            return f"{local(recorded)} cannot be read: {error.strerror}"
    return None


def look_up(entry: Path, key: str) -> Lookup:
    """Checks an entry as a reader does, without a lock or a write: who may have written it,
    its record and key, its library against the recorded digest (read through the
    descriptor that the caller loads), and the kernel's own headers against theirs. Raises
    JitCacheTrustError for an entry that others could have written."""
    meta = read_meta(entry)
    if meta is None:
        damaged = (entry / META_FILE).exists()
        return Lookup(problem=f"its {META_FILE} is damaged" if damaged else None)
    if meta.get("format") != FORMAT:
        return Lookup(problem=f"it was written by another jitk (format {meta.get('format')})")
    if meta.get("key") != key:
        return Lookup(problem="it was built from other inputs: other kernel files, flags "
                      "or template arguments")
    try:
        trust.check(entry, "the cache entry")
    except FileNotFoundError:
        return Lookup()  # removed while we looked
    fd, problem = _open_in_entry(entry, meta.get("library"))
    if fd is None:
        return Lookup(problem=problem)
    library = entry / meta["library"]
    try:
        trust.check(library, "the library", os.fstat(fd))
        if digest_fd(fd) != meta.get("sha256"):
            problem = f"{library.name} is damaged (its digest changed)"
        else:
            problem = _headers_problem(meta)
        if not problem:
            device_code, problem = _read_device_code(entry, meta)
    except BaseException:
        os.close(fd)
        raise
    if problem:
        os.close(fd)
        return Lookup(problem=problem)
    return Lookup(library=library, fd=fd, device_code=device_code)


def _read_device_code(entry: Path, meta: dict) -> tuple[dict[str, bytes], str | None]:
    """The device code NVRTC built beside the library (jitk/nvrtc.cuh), read once and checked
    against the recorded digests: these bytes, not the files, are what the library is given
    (loader.load_from_fd), so a file swapped after the check changes nothing. With why
    they cannot be used, if so."""
    recorded = meta.get("device_code", {})
    if not isinstance(recorded, dict):
        return {}, f"its {META_FILE} lists its device code wrongly"
    code = {}
    for name, expected in recorded.items():
        fd, problem = _open_in_entry(entry, name)
        if fd is None:
            return {}, problem or f"{entry} went while it was read"
        try:
            trust.check(entry / name, "the device code", os.fstat(fd))
            with os.fdopen(fd, "rb", closefd=False) as file:
                data = file.read()
        finally:
            os.close(fd)
        if digest_bytes(data) != expected:
            return {}, f"{name} is damaged (its digest changed)"
        code[name] = data
    return code, None


def is_complete(entry: Path, key: str) -> bool:
    """Whether `entry` holds a whole, usable build of `key`."""
    found = look_up(entry, key)
    if found.fd is not None:
        os.close(found.fd)
    return found.library is not None


def write_meta(staging: Path, meta: dict) -> None:
    (staging / META_FILE).write_text(json.dumps({"format": FORMAT, **meta}, indent=1))


def make_folder(folder: Path) -> None:
    """Creates `folder` (and its parents) writable by its owner, or the trusted group."""
    folder.mkdir(parents=True, exist_ok=True, mode=trust.folder_mode())


def build_lock_path(entry: Path, in_place: bool = False) -> Path:
    """The lock a build of `entry` holds: a build_directory keeps its own inside it."""
    return entry / OWN_DIR / "build.lock" if in_place else lock_path(entry)


def _copies_folder(entry: Path, in_place: bool) -> Path:
    return entry / OWN_DIR / STAGING_DIR.lstrip(".") if in_place else entry.parent / STAGING_DIR


def copy_in(staging: Path, entry: Path, in_place: bool = False) -> Path:
    """A private copy of the finished build in `staging`, on the entry's file system (the
    build folder holds files only), its record written last. A copy that fails (a full disk)
    is removed and raises CacheWriteError."""
    private = _copies_folder(entry, in_place) / private_name(entry)
    try:
        make_folder(private.parent)
        private.mkdir(mode=trust.folder_mode())
        for source in sorted((p for p in staging.iterdir() if p.is_file()),
                             key=lambda p: p.name == META_FILE):
            target = private / source.name
            shutil.copyfile(source, target)
            target.chmod(trust.file_mode(source.stat().st_mode))
    except OSError as error:
        shutil.rmtree(private, ignore_errors=True)
        code = errno.errorcode.get(error.errno, "?")
        failed = CacheWriteError(
            f"could not copy the build of {entry.name} into {private.parent}: "
            f"{error.strerror} (errno {error.errno}, {code}); nothing was published: free "
            f"space there or set {CACHE_ENV}")
        failed.errno = error.errno
        raise failed from None
    return private


def staging_folders(root: Path) -> list[Path]:
    folder = root / STAGING_DIR
    return sorted(folder.iterdir()) if folder.is_dir() else []


def discard(entry: Path) -> bool:
    """Removes an entry: renamed into the trash (one step for readers), then deleted.
    Returns False when it was already gone."""
    trash = entry.parent / TRASH_DIR / private_name(entry)
    make_folder(trash.parent)
    try:
        entry.rename(trash)
    except FileNotFoundError:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


def publish(private: Path, entry: Path, key: str) -> None:
    """Makes the private copy the entry, in one rename. The caller holds the build lock and
    found no usable entry, but a builder on another host (whose locks are its own) may have
    published one since: a complete one stays and ours is discarded; a damaged or stale one
    goes first (a reader in between finds none, and waits on the lock or builds)."""
    for _ in range(3):
        try:
            private.rename(entry)
            return
        except OSError as error:
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        if is_complete(entry, key):
            logger.info("jitk: %s was published meanwhile (by another host); this build's "
                        "copy is discarded", entry)
            shutil.rmtree(private, ignore_errors=True)
            return
        discard(entry)
    shutil.rmtree(private, ignore_errors=True)
    raise OSError(errno.EBUSY, f"jitk could not publish {entry}: other processes kept "
                  "replacing it with unusable entries")


def publish_in_place(private: Path, folder: Path) -> None:
    """Replaces the build in a build_directory by the private copy: its record goes first
    and the new one comes last, so a reader finds a whole build or no record."""
    (folder / META_FILE).unlink(missing_ok=True)
    trash = folder / OWN_DIR / TRASH_DIR.lstrip(".") / private.name
    make_folder(trash)
    for old in folder.iterdir():
        if old.name != OWN_DIR:
            old.rename(trash / old.name)
    for new in sorted(private.iterdir(), key=lambda p: p.name == META_FILE):  # record last
        new.rename(folder / new.name)
    private.rmdir()
    shutil.rmtree(trash, ignore_errors=True)


def check_build_directory(folder: Path) -> None:
    """A build_directory is jitk's only if jitk made it: a folder that is not empty and
    holds no jitk build is refused (ValueError), never emptied."""
    if not folder.exists():
        return
    if not folder.is_dir():
        raise ValueError(f"load_jit(build_directory=...): {folder} is a file, not a folder")
    if (folder / META_FILE).is_file() or (folder / OWN_DIR).is_dir():
        return
    if next(folder.iterdir(), None) is not None:
        raise ValueError(
            f"load_jit(build_directory=...): {folder} is not empty and holds no jitk build "
            f"(no {META_FILE}); jitk builds only in a new or empty folder, or one it built "
            "before, because a new build replaces a folder's contents. Give another folder")


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    module: str
    archs: tuple[str, ...]
    size_bytes: int
    age_seconds: float
    problem: str | None = None  # why its record is damaged; load_jit rebuilds such an entry


def folder_size(folder: Path) -> int:
    size = 0
    for path in folder.rglob("*"):
        try:
            size += path.stat().st_size if path.is_file() else 0
        except OSError:
            pass  # removed meanwhile
    return size


def _entry(folder: Path) -> CacheEntry | None:
    """The entry in `folder`, damaged or not, if jitk provably made it: its name is an
    entry's and it holds a record (None: someone else's folder, or one going away)."""
    named = ENTRY_NAME.fullmatch(folder.name)
    try:
        if named is None or not (folder / META_FILE).is_file():
            return None
        meta = read_meta(folder)
        problem = (f"its {META_FILE} cannot be read" if meta is None
                   else record_problem(folder, meta))
        built_at = folder.stat().st_mtime if problem else meta["built_at"]
    except OSError:
        return None
    if problem:
        return CacheEntry(folder, named["module"], (), folder_size(folder),
                          time.time() - built_at, problem)
    return CacheEntry(folder, meta["module"], tuple(meta["archs"]), folder_size(folder),
                      time.time() - built_at)


def _top_folders(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def list_entries(root: Path | None = None) -> list[CacheEntry]:
    """Every published entry under the cache, newest first, the damaged ones (a record of
    the wrong shape) included with their problem."""
    entries = [e for folder in _top_folders(root or cache_root()) if (e := _entry(folder))]
    return sorted(entries, key=lambda e: e.age_seconds)


def foreign_folders(root: Path | None = None) -> list[Path]:
    """The folders in the cache that jitk did not make (no entry's name, or no record):
    nothing removes them."""
    return [f for f in _top_folders(root or cache_root()) if _entry(f) is None]


def tidy(root: Path) -> list[str]:
    """Removes what no build owns any more: private copies whose builder is gone (another
    host's once they are an hour old), lock files nobody holds, and the trash. Returns what
    could not be removed."""
    failures = []
    for private in staging_folders(root):
        try:
            if is_private_name(private.name) and abandoned(private):
                shutil.rmtree(private, ignore_errors=True)
        except FileNotFoundError:
            pass  # its builder published it
    locks = lock_folder(root)
    for path in sorted(locks.glob(f"*{LOCK_SUFFIX}")) if locks.is_dir() else ():
        if not is_entry_name(entry_name(path) or ""):
            continue  # not a lock jitk names: another program's
        try:
            fd = try_lock(path)
        except JitLockError as error:
            failures.append(str(error))
            continue
        if fd is not None:
            try:
                path.unlink(missing_ok=True)  # a waiter that opened it notices and reopens
            finally:
                release(fd)
    trash = root / TRASH_DIR
    for folder in sorted(trash.iterdir()) if trash.is_dir() else ():
        if is_private_name(folder.name):  # a concurrent clear may be deleting it too
            shutil.rmtree(folder, ignore_errors=True)
    return failures


def prune(doomed: list[CacheEntry], root: Path | None = None) -> tuple[int, list[str]]:
    """Removes the selected entries and whatever no running build owns (tidy). Returns how
    many entries went and what could not be removed."""
    root = root or cache_root()
    removed, failures = 0, []
    for entry in doomed:
        try:
            removed += discard(entry.path)
        except OSError as error:
            failures.append(f"{entry.path}: {error.strerror}")
    return removed, failures + (tidy(root) if root.is_dir() else [])


def clear(root: Path | None = None) -> tuple[int, list[str]]:
    """Removes every entry (the damaged ones too), and whatever no running build owns;
    builds in progress, held locks and what jitk did not make are left alone."""
    return prune(list_entries(root), root)
