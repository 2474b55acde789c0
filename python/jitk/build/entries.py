"""Where a build's entry lives in the cache, and how a reader finds and loads one: the exact
entry, or one built for more architectures that serves these (load_jit, jitk/build/jit.py)."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import tvm_ffi

from jitk.build import cache, loader, names, toolchain, trust
from jitk.build.spec import BuildSpec

__all__ = ["covering_entries", "entry_key", "folder_name", "load_cached", "look_up"]

logger = logging.getLogger("jitk")


def _look_up_entry(entry: Path, key: str) -> cache.Lookup:
    found = cache.look_up(entry, key)
    if found.problem:  # perhaps read while another process replaced the entry: look again
        found = cache.look_up(entry, key)
    return found


def look_up(spec: BuildSpec) -> cache.Lookup:
    """The entry's checked library, after checking who may have written the cache."""
    root = spec.entry if spec.in_place else spec.entry.parent
    if root.exists():
        trust.check(root, "the build directory" if spec.in_place else "the cache")
    return _look_up_entry(spec.entry, spec.key)


def entry_key(build_key: str, archs: tuple[str, ...]) -> str:
    """The key an entry records: its build's (which leaves the architectures out) with the
    architectures it was built for, so that a build_directory rebuilt for others is stale."""
    return hashlib.sha256(f"{build_key}:{';'.join(archs)}".encode()).hexdigest()


def folder_name(name: str, build_key: str, archs: tuple[str, ...]) -> str:
    """An entry's folder: the module, the build key's first 16 digits, the architectures."""
    return f"{name}_{build_key[:16]}" + (f"_{toolchain.archs_tag(archs)}" if archs else "")


def covering_entries(spec: BuildSpec, build_key: str) -> list[tuple[Path, tuple[str, ...]]]:
    """Entries of the same build for other sets of architectures (the same folder name up
    to the architectures' tag) that serve every architecture of `spec`, those with machine
    code for all of them first. Read only when the exact entry is missing."""
    prefix = folder_name(spec.name, build_key, ()) + "_"
    try:
        others = sorted(name for name in os.listdir(spec.entry.parent)
                        if name.startswith(prefix) and "." not in name
                        and name != spec.entry.name)
    except OSError:
        return []
    ranked = []
    for name in others:
        folder = spec.entry.parent / name
        meta = cache.read_meta(folder) or {}
        if names.record_problem(folder, meta):
            continue  # a damaged record (a field of the wrong type, say) serves nothing
        try:
            built = toolchain.parse_archs(";".join(map(str, meta.get("archs") or ())))
        except toolchain.ToolchainError:
            continue  # not an entry of this build; its key check would refuse it anyway
        ways = [toolchain.serves(built, wanted) for wanted in spec.archs]
        if all(ways):
            ranked.append(("ptx" in ways, name, built))
    return [(spec.entry.parent / name, built) for _, name, built in sorted(ranked)]


def load_cached(spec: BuildSpec, build_key: str | None
                 ) -> tuple[tvm_ffi.Module | None, tuple[str, ...], str | None]:
    """The module from the exact entry, else (given the build's key, in the shared cache)
    from an entry for more architectures that covers these; with the architectures it holds,
    or why the exact entry cannot be used."""
    found = look_up(spec)
    if found.fd is not None:
        return loader.load_from_fd(found.fd, found.device_code), spec.archs, None
    for entry, built in covering_entries(spec, build_key) if build_key and spec.archs else ():
        other = _look_up_entry(entry, entry_key(build_key, built))
        if other.fd is not None:
            logger.info("jitk: %s for %s served by %s", spec.name, ", ".join(spec.archs), entry)
            return loader.load_from_fd(other.fd, other.device_code), built, None
    return None, spec.archs, found.problem
