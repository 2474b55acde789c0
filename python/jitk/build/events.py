"""What load_jit did, call by call: one event per lookup that ended (a module found in the
disk cache, fetched from the remote cache, built, or none of these), with the process's
counts and seconds per kind. `jitk.jit_stats()` returns them; at JITK_LOGLEVEL>=1 each event
is also one line on stderr:

    jitk: jit build rmsnorm_4096_bf16_t key 1f0c2a9e5b7d3c41 <seconds> s (compilers <s>, ...)

A build's event also holds what its time went to, seconds a phase (jitk.build.builder.PHASES:
the compilers ninja ran, NVRTC in the process, the copy into the cache and its load).

The kinds are disjoint: "disk" (a usable entry in the cache, this process's or another's),
"remote" (fetched from the registry, verified and published), "build" (compiled here) and
"miss" (no entry and no module: JIT compilation disabled, or no build: it failed, or the wait
for another process's build ran out). A cache miss is any of the last three. `python -m jitk
cache pull` fills the cache without loading, so its fetches are not events."""

from __future__ import annotations

import collections
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

from jitk.base import settings
from jitk.base.errors import ArgumentError, ArgumentTypeError

__all__ = ["KINDS", "JitEvent", "count", "jit_stats", "record"]

KINDS = ("disk", "remote", "build", "miss")
RECENT = 1000  # the most events jit_stats() keeps, the newest last
KEY_DIGITS = 16  # of the key an event shows, as an entry's folder name shows it

_lock = threading.Lock()
_counts = dict.fromkeys(KINDS, 0)
_seconds = dict.fromkeys(KINDS, 0.0)
_since_start = dict.fromkeys(KINDS, 0)  # what count() reads: jit_stats(reset=True) keeps it
_recent: collections.deque[JitEvent] = collections.deque(maxlen=RECENT)


@dataclass(frozen=True)
class JitEvent:
    module: str
    key: str  # the build's key, its first KEY_DIGITS digits
    seconds: float  # from the call's lookup to its module (or its failure)
    source: str  # one of KINDS
    at: float  # time.time() when it ended
    phases: dict[str, float] = field(default_factory=dict)  # a build's: phase -> seconds

    def line(self) -> str:
        phases = ", ".join(f"{name} {seconds:.3f}" for name, seconds in self.phases.items())
        return (f"jitk: jit {self.source} {self.module} key {self.key} {self.seconds:.3f} s"
                + (f" ({phases})" if phases else ""))


def record(module: str, key: str, source: str, started: float,
           phases: dict[str, float] | None = None) -> JitEvent:
    """Counts one event that began at time.perf_counter() `started` (a build's with the
    seconds of its `phases`), and prints it at JITK_LOGLEVEL>=1."""
    if source not in KINDS:
        raise ArgumentError(f"jit event source {source!r}: expected one of {', '.join(KINDS)}")
    event = JitEvent(module, key[:KEY_DIGITS], time.perf_counter() - started, source,
                     time.time(), dict(phases or {}))
    with _lock:
        _counts[source] += 1
        _since_start[source] += 1
        _seconds[source] += event.seconds
        _recent.append(event)
    if int(settings.get("JITK_LOGLEVEL")) >= 1:
        print(event.line(), file=sys.stderr, flush=True)
    return event


def count(source: str) -> int:
    """How many events of one kind this process has had since it started."""
    return _since_start[source]


def jit_stats(reset: bool = False) -> dict:
    """This process's load_jit events: per kind ("disk", "remote", "build", "miss") the count
    and the total seconds, and the most recent events (at most 1000, oldest first) as dicts
    with module, key, seconds, source, at (a time.time()) and phases (a build's seconds a
    phase, jitk.build.builder.PHASES; empty for the other kinds). With reset=True the counts and
    the events start again from nothing after they are read (count() and
    jitk.build.jit.build_count() go on counting from the process's start)."""
    if not isinstance(reset, bool):
        raise ArgumentTypeError(f"jit_stats(reset=...): expected a bool, got "
                                f"{type(reset).__name__} {reset!r:.60}")
    with _lock:
        stats = {kind: {"count": _counts[kind], "seconds": _seconds[kind]} for kind in KINDS}
        stats["events"] = [asdict(event) for event in _recent]
        if reset:
            _counts.update(dict.fromkeys(KINDS, 0))
            _seconds.update(dict.fromkeys(KINDS, 0.0))
            _recent.clear()
    return stats
