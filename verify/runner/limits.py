"""How many ranks this machine runs and how much memory each may hold: plain numbers, free of torch,
so the command line checks them before anything heavy is imported."""
from __future__ import annotations

import os

DEFAULT_MEMORY_MB = 4096  # per rank; override with Gang(memory_mb=...) or ``--rank-memory``
RANKS_PER_CORE = 4  # more ranks than this per core cannot make progress on a loaded machine


def max_ranks() -> int:
    """The most ranks this machine runs: ``RANKS_PER_CORE`` per usable core."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return RANKS_PER_CORE * cores
