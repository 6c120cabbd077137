"""Collective time by an alpha-beta model: ``steps * alpha + busbytes / beta`` for a ring.

``nbytes`` is the size per rank of the larger side of the collective (the gathered or reduced
buffer), as nccl-tests counts it; the bus factor turns it into the bytes each rank actually sends.
"""
from __future__ import annotations

import math
from typing import Sequence

from ..profiles import DeviceProfile

# kind -> (ring steps as a multiple of (f - 1), bytes sent per rank as a multiple of (f - 1) / f * nbytes)
_RING = {"all_reduce": (2, 2.0), "all_gather": (1, 1.0), "reduce_scatter": (1, 1.0), "all_to_all": (1, 1.0)}


# how nnscaler.runtime.collectives carries out each kind today: (the collective it issues, the factor on
# the bytes it moves): reduce-scatter sums the whole tensor then keeps a chunk; all-to-all gathers the
# whole dim then keeps a chunk. Change this table with the runtime.
RUNTIME = {"reduce_scatter": ("all_reduce", 1), "all_to_all": ("all_gather", None)}


def runtime_time(kind: str, nbytes: float, f: int, profile: DeviceProfile, across_nodes: bool,
                 latency_share: float = 1.0) -> float:
    """Seconds the runtime takes for a collective of ``kind`` (see ``RUNTIME``)."""
    issued, factor = RUNTIME.get(kind, (kind, 1))
    return collective_time(issued, nbytes * (f if factor is None else factor), f, profile, across_nodes, latency_share)


def spans_nodes(mesh_shape: Sequence[int], axis: int, profile: DeviceProfile) -> bool:
    """Whether the groups of ``axis`` (row-major mesh, last axis contiguous ranks) leave one node."""
    stride = math.prod(mesh_shape[axis + 1:])
    return stride * mesh_shape[axis] > profile.ranks_per_node


def collective_time(kind: str, nbytes: float, f: int, profile: DeviceProfile, across_nodes: bool,
                    latency_share: float = 1.0) -> float:
    """Seconds for one collective of ``kind`` over ``f`` ranks moving ``nbytes`` per rank
    (``latency_share``: the part of its latency it pays, when it rides in a shared bucket)."""
    if f <= 1 or kind not in _RING:
        return 0.0
    steps, factor = _RING[kind]
    alpha, beta = profile.link(across_nodes)
    return latency_share * steps * (f - 1) * alpha + factor * (f - 1) / f * nbytes / beta
