"""Which cache entries `jitk cache prune` removes (jitk/build/cache.py removes them)."""

from __future__ import annotations

from jitk.build.cache import CacheEntry


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
    for entry in entries:  # newest first; a damaged entry serves nobody
        if entry.problem is None:
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
