"""How many CPUs a build may take: its share of them, less the machine's load."""

from __future__ import annotations

import os

__all__ = ["share_cpus", "spare_cpus"]

_sharing = 1  # how many processes build side by side with this one (share_cpus)


def share_cpus(processes: int) -> None:
    """Says that this process is one of `processes` building side by side (precompile's
    workers), so that its builds take their share of the CPUs rather than all of them."""
    global _sharing
    _sharing = max(1, processes)


def spare_cpus() -> int:
    """The CPUs this process's build may take, one at least: its share of them (share_cpus),
    less the last minute's load, so that builds side by side do not each take every CPU for
    their units (a load average lags: a burst of builds is what share_cpus is for)."""
    cpus = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average here
        load = 0.0
    return max(1, min(cpus // _sharing, round(cpus - load)))
