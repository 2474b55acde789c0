"""Where builds run: a fresh folder per build on the builder's own host ($JITK_STAGING_DIR,
else the temporary folder), outside the cache; jitk/build/cache.py copies the finished build
from there onto the cache's file system."""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

from jitk.base import settings
from jitk.build.cache import folder_setting, make_folder

STAGING_ENV = "JITK_STAGING_DIR"


def staging_root() -> Path:
    """$JITK_STAGING_DIR, else the temporary folder (both host-local)."""
    return folder_setting(STAGING_ENV, settings.get(STAGING_ENV) or tempfile.gettempdir())


def _prefix(entry: Path) -> str:
    where = hashlib.sha256(str(entry).encode()).hexdigest()[:8]
    return f"jitk-{re.sub(r'[^A-Za-z0-9_]+', '_', entry.name[:80])}-{where}-"


def new_staging(entry: Path) -> Path:
    """A fresh folder, private to this process, for a build of `entry` on this host."""
    root = staging_root()
    make_folder(root)
    return Path(tempfile.mkdtemp(prefix=_prefix(entry), dir=root))


def old_stagings(entry: Path) -> list[Path]:
    """This user's earlier build folders of `entry` on this host: failed builds, kept for
    inspection, and killed ones. Only the holder of the entry's lock may remove them."""
    root = staging_root()
    found = root.glob(f"{_prefix(entry)}*") if root.is_dir() else ()
    return sorted(p for p in found if p.is_dir() and p.stat().st_uid == os.geteuid())
