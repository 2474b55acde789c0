"""The on-disk module cache: where it is, how an entry is published and checked, what is in it.

    <root>/<module>_<key>/            a published entry; never changed once published
    <root>/<module>_<key>.lock        its build lock (jitk/lock.py); only builds take it
    <root>/.staging/<entry>.<pid>.<n> a build in progress, private to its builder
    <root>/.trash/<entry>.<pid>.<n>   an entry on its way out

A build runs in a staging folder and becomes the entry in one rename, with jitk-meta.json
written last inside it, so a reader finds a whole entry or none. Reading takes no lock and
writes nothing: the entry is checked (the library against the digest taken when it was
built, the builder's own headers against theirs) and loaded. An entry is removed by renaming
it into .trash first, so a reader never sees half of one."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from .lock import JitLockError, lock_path, release, try_lock

CACHE_ENV = "JITK_CACHE_DIR"
META_FILE = "jitk-meta.json"
FORMAT = 2  # of an entry; part of every cache key
STAGING_DIR = ".staging"
TRASH_DIR = ".trash"
PACKAGE_DIR = Path(__file__).resolve().parent
# Stands for PACKAGE_DIR in keys and recorded paths, so that a cache filled by one
# installation of jitk is hit by another one of the same version elsewhere.
PACKAGE_MARK = "<jitk>"


def cache_root() -> Path:
    """$JITK_CACHE_DIR, else ~/.cache/jitk: a folder, made when first built into."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "jitk").expanduser()
    if root.exists() and not root.is_dir():
        raise ValueError(f"{CACHE_ENV}={str(root)!r} is a file; it must name a folder (jitk "
                         "makes it if it is missing)")
    return root


def portable(path: Path | str) -> str:
    """A path with the package's location replaced by PACKAGE_MARK."""
    text = str(path)
    return text.replace(str(PACKAGE_DIR), PACKAGE_MARK, 1) if text.startswith(
        str(PACKAGE_DIR) + os.sep) else text


def local(recorded: str) -> Path:
    """The inverse of portable() for this installation."""
    return Path(recorded.replace(PACKAGE_MARK, str(PACKAGE_DIR), 1))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_meta(entry: Path) -> dict | None:
    """The entry's record, or None when there is no (readable) entry."""
    try:
        meta = json.loads((entry / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


@dataclass(frozen=True)
class Lookup:
    """What a reader found: a checked library to load, or why there is none to load
    (`problem` is None when there is simply no entry)."""

    library: Path | None = None
    problem: str | None = None


def look_up(entry: Path) -> Lookup:
    """Checks an entry as a reader does, without a lock or a write: its record, its library
    against the recorded digest, and the kernel's own headers against theirs."""
    meta = read_meta(entry)
    if meta is None:
        damaged = (entry / META_FILE).exists()
        return Lookup(problem=f"its {META_FILE} is damaged" if damaged else None)
    if meta.get("format") != FORMAT:
        return Lookup(problem=f"it was written by another jitk (format {meta.get('format')})")
    library = entry / str(meta.get("library"))
    try:
        if digest(library) != meta.get("sha256"):
            return Lookup(problem=f"{library.name} is damaged (its digest changed)")
        for recorded, expected in meta.get("headers", {}).items():
            if digest(local(recorded)) != expected:
                return Lookup(problem=f"{local(recorded)} changed since it was built")
    except FileNotFoundError as error:
        if not entry.is_dir():
            return Lookup()  # removed while we looked
        return Lookup(problem=f"{error.filename} is missing")
    except OSError as error:
        return Lookup(problem=f"{error.filename} cannot be read: {error.strerror}")
    return Lookup(library=library)


def write_meta(staging: Path, meta: dict) -> None:
    (staging / META_FILE).write_text(json.dumps({"format": FORMAT, **meta}, indent=1))


def _private_name(entry: Path) -> str:
    return f"{entry.name}.{os.getpid()}.{time.monotonic_ns()}"


def entry_of(private: Path) -> str:
    """The entry name a staging or trash folder belongs to."""
    return private.name.rsplit(".", 2)[0]


def new_staging(entry: Path) -> Path:
    """A fresh private folder for a build of `entry`, on its file system."""
    staging = entry.parent / STAGING_DIR / _private_name(entry)
    staging.mkdir(parents=True)
    return staging


def staging_folders(root: Path) -> list[Path]:
    folder = root / STAGING_DIR
    return sorted(folder.iterdir()) if folder.is_dir() else []


def discard(entry: Path) -> bool:
    """Removes an entry: renamed into the trash (one step for readers), then deleted.
    Returns False when it was already gone."""
    trash = entry.parent / TRASH_DIR / _private_name(entry)
    trash.parent.mkdir(exist_ok=True)
    try:
        entry.rename(trash)
    except FileNotFoundError:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


def publish(staging: Path, entry: Path) -> None:
    """Makes the finished build in `staging` the entry, in one rename. The caller holds the
    build lock and found no usable entry, so one still there is damaged or stale: it goes
    first (a reader in between finds none, waits on the lock and finds the new one)."""
    try:
        staging.rename(entry)
    except OSError as error:
        if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        discard(entry)
        staging.rename(entry)


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    module: str
    archs: tuple[str, ...]
    size_bytes: int
    age_seconds: float


def folder_size(folder: Path) -> int:
    size = 0
    for path in folder.rglob("*"):
        try:
            size += path.stat().st_size if path.is_file() else 0
        except OSError:
            pass  # removed meanwhile
    return size


def list_entries(root: Path | None = None) -> list[CacheEntry]:
    """Every published entry under the cache, newest first."""
    root = root or cache_root()
    entries = []
    for meta_path in root.glob(f"*/{META_FILE}") if root.is_dir() else ():
        directory = meta_path.parent
        meta = read_meta(directory)
        if directory.name.startswith(".") or meta is None:
            continue  # damaged: load_jit rebuilds such an entry
        built_at = meta.get("built_at", time.time())
        entries.append(CacheEntry(directory, meta.get("module", directory.name),
                                  tuple(meta.get("archs", ())), folder_size(directory),
                                  time.time() - built_at))
    return sorted(entries, key=lambda e: e.age_seconds)


def _published_folders(root: Path) -> list[Path]:
    """Every entry folder, including damaged ones and those of an older jitk."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def _discard_all(folders: list[Path]) -> tuple[int, list[str]]:
    removed, failures = 0, []
    for folder in folders:
        try:
            removed += discard(folder)
        except OSError as error:
            failures.append(f"{folder}: {error.strerror}")
    return removed, failures


def tidy(root: Path) -> list[str]:
    """Removes what no build owns any more: staging folders of finished, failed or killed
    builds (a build holds its entry's lock while its folder exists), lock files nobody
    holds, and the trash. Returns what could not be removed."""
    failures = []
    for staging in staging_folders(root):
        try:
            fd = try_lock(lock_path(root / entry_of(staging)))
        except JitLockError as error:
            failures.append(str(error))
            continue
        if fd is None:
            continue  # a build is running there
        try:
            shutil.rmtree(staging, ignore_errors=True)
        finally:
            release(fd)
    for path in sorted(root.glob("*.lock")) if root.is_dir() else ():
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
        shutil.rmtree(folder, ignore_errors=True)  # a concurrent clear may be deleting it too
    return failures


def clear(root: Path | None = None) -> tuple[int, list[str]]:
    """Removes every entry, and whatever no running build owns; builds in progress and held
    locks are left alone. Returns how many entries went and what could not be removed."""
    root = root or cache_root()
    removed, failures = _discard_all(_published_folders(root))
    return removed, failures + (tidy(root) if root.is_dir() else [])


def select_for_pruning(entries: list[CacheEntry], older_than_days: float | None = None,
                       keep: int | None = None, max_bytes: int | None = None,
                       targets: list[tuple[str, ...]] | None = None) -> list[CacheEntry]:
    """The entries (newest first) that go: older than the age, beyond the newest `keep`
    versions of their configuration, then the oldest of the rest until the cache fits in
    `max_bytes`. A configuration is a module name (which holds the template arguments) built
    for one set of architectures, so versions are counted per architecture. Without
    `targets`, the newest version of each configuration always stays: a cache filled for
    several GPUs keeps serving each of them. With `targets` (architecture sets, () for host
    code), only entries built for one of them are selected, their last versions included."""
    def configuration(entry: CacheEntry) -> tuple[str, tuple[str, ...]]:
        return entry.module, tuple(sorted(entry.archs))

    wanted = None if targets is None else {tuple(sorted(t)) for t in targets}
    candidates = [e for e in entries if wanted is None or configuration(e)[1] in wanted]
    newest: dict[tuple[str, tuple[str, ...]], CacheEntry] = {}
    for entry in entries:  # newest first
        newest.setdefault(configuration(entry), entry)
    protected = set(newest.values()) if wanted is None else set()
    doomed: set[CacheEntry] = set()
    if older_than_days is not None:
        doomed.update(e for e in candidates if e.age_seconds > older_than_days * 86400)
    if keep is not None:
        seen: dict[tuple[str, tuple[str, ...]], int] = {}
        for entry in candidates:  # newest first
            seen[configuration(entry)] = seen.get(configuration(entry), 0) + 1
            if seen[configuration(entry)] > keep:
                doomed.add(entry)
    if max_bytes is not None:
        total = sum(e.size_bytes for e in entries if e not in doomed)
        for entry in reversed(candidates):  # oldest first
            if total <= max_bytes:
                break
            if entry not in doomed and entry not in protected:
                doomed.add(entry)
                total -= entry.size_bytes
    return [e for e in entries if e in doomed and e not in protected]


def prune(doomed: list[CacheEntry], root: Path | None = None) -> tuple[int, list[str]]:
    """Removes the selected entries and whatever no running build owns."""
    root = root or cache_root()
    removed, failures = _discard_all([e.path for e in doomed])
    return removed, failures + (tidy(root) if root.is_dir() else [])
