"""The on-disk module cache: where it is, what is in it, and emptying it."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "JITK_CACHE_DIR"
META_FILE = "jitk-meta.json"


def cache_root() -> Path:
    """$JITK_CACHE_DIR, else ~/.cache/jitk."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "jitk").expanduser()


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    module: str
    archs: tuple[str, ...]
    size_bytes: int
    age_seconds: float


def list_entries(root: Path | None = None) -> list[CacheEntry]:
    """Every successfully built module under the cache, newest first."""
    root = root or cache_root()
    entries = []
    for meta_path in root.glob(f"*/{META_FILE}") if root.is_dir() else ():
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            continue  # being written, or damaged: load_jit rebuilds such an entry
        directory = meta_path.parent
        size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
        entries.append(CacheEntry(directory, meta.get("module", directory.name),
                                  tuple(meta.get("archs", ())), size,
                                  time.time() - meta.get("built_at", time.time())))
    return sorted(entries, key=lambda e: e.age_seconds)


def clear(root: Path | None = None) -> int:
    """Removes every cache entry; returns how many folders went."""
    root = root or cache_root()
    if not root.is_dir():
        return 0
    removed = 0
    for child in root.iterdir():
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
            removed += 1
    return removed
