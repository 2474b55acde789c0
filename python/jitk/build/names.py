"""How jitk names what it makes in a cache, and how it recognises its own: jitk removes only
what these names and an entry's record prove it made (jitk/build/cache.py).

    <module>_<16 hex>[_<archs tag>]   an entry's folder (jitk/build/jit.py names it)
    <entry>.<host>-<pid>-<n>          a private copy of an entry, in .staging or .trash
    .pch/<64 hex>[.<host>-<pid>-<n>]  a host prelude (jitk/build/pch.py), and one being built

A folder in the cache that is not named like an entry, or holds no record, is someone
else's and stays, as do lock files of other names."""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path

META_FILE = "jitk-meta.json"
# A private copy made on another host is left alone this long: its builder may still be
# copying it (seconds); after that it is a leftover of a killed one.
FOREIGN_COPY_SECONDS = 3600
# After the module name: the build key's first 16 digits, then for a CUDA build the
# architectures' tag (toolchain.archs_tag).
ENTRY_TAIL = r"_[0-9a-f]{16}(?:_sm\d+[a-z]?(?:-\d+[a-z]?)*)?"
ENTRY_NAME = re.compile(r"(?P<module>[A-Za-z0-9_]+)" + ENTRY_TAIL)
PRIVATE_NAME = re.compile(r"(?P<entry>[^.]+)\.(?P<host>.+)-(?P<pid>\d+)-\d+")
# The fields (and their types) of the record jitk writes last into every entry.
RECORD_FIELDS = {"format": (int,), "module": (str,), "key": (str,), "library": (str,),
                 "sha256": (str,), "archs": (list,), "built_at": (int, float),
                 "headers": (dict,)}


def is_entry_name(name: str) -> bool:
    """Whether `name` is one jitk gives an entry's folder."""
    return ENTRY_NAME.fullmatch(name) is not None


def record_problem(folder: Path, meta: dict) -> str | None:
    """Why `meta` is not a record jitk wrote for `folder`, or None when it is one."""
    for field, kinds in RECORD_FIELDS.items():
        value = meta.get(field)
        if isinstance(value, bool) or not isinstance(value, kinds):
            expected = " or ".join(kind.__name__ for kind in kinds)
            return f"its {META_FILE} field {field!r} is {value!r:.40}, expected {expected}"
    if not all(isinstance(arch, str) for arch in meta["archs"]):
        return f"its {META_FILE} field 'archs' is {meta['archs']!r:.40}, expected strings"
    module = meta["module"]
    if not (folder.name.startswith(module)
            and re.fullmatch(ENTRY_TAIL, folder.name[len(module):])):
        return f"its {META_FILE} names module {module!r:.40}, not the folder's"
    return None


def host() -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", socket.gethostname()) or "host"


def private_name(entry: Path) -> str:
    return f"{entry.name}.{host()}-{os.getpid()}-{time.monotonic_ns()}"


def is_private_name(name: str) -> bool:
    """Whether `name` is one private_name gives a copy of an entry."""
    found = PRIVATE_NAME.fullmatch(name)
    return found is not None and is_entry_name(found["entry"])


def is_private_copy_of(name: str, folder: Path) -> bool:
    """Whether `name` is one private_name gives a copy of `folder` (any jitk folder)."""
    found = PRIVATE_NAME.fullmatch(name)
    return found is not None and found["entry"] == folder.name


def abandoned(private: Path) -> bool:
    """Whether a private copy's builder is gone: on this host, its process has ended;
    elsewhere (or from an older jitk), the copy is older than any publication takes."""
    owner = PRIVATE_NAME.fullmatch(private.name)
    if owner and owner["host"] == host():
        try:
            os.kill(int(owner["pid"]), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # alive, another user's
        return False
    return time.time() - private.stat().st_mtime > FOREIGN_COPY_SECONDS
