"""The collectives one layout-conversion step issues in forward and backward, with their time."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..dimops.layout import Layout, Shard
from ..ir.graph import ACTIVATION, PARAM, IRTensor
from ..runtime.grad_sync import BUCKET_BYTES
from .comm import runtime_time, spans_nodes
from .profiles import DeviceProfile

OPTIMIZER_STATES = 2  # AdamW keeps exp_avg and exp_avg_sq, each the size of the parameter
# a step's forward collective, and the one its backward issues (for tensors that carry gradients)
_FORWARD = {"all_gather": "all_gather", "all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter",
            "all_to_all": "all_to_all", "all_gather_sum_grad": "all_gather"}
_BACKWARD = {"split": "all_gather", "reduce_scatter": "all_gather", "grad_all_reduce": "all_reduce",
             "all_to_all": "all_to_all", "all_gather_sum_grad": "reduce_scatter"}


@dataclass(frozen=True)
class Collective:
    """One collective a rank issues per step: ``phase`` forward, backward or grad sync."""

    phase: str
    kind: str
    axis: str
    ranks: int
    nbytes: int
    seconds: float
    tensor: str = ""


def nbytes(t: IRTensor) -> int:
    return math.prod(t.shape) * t.dtype.itemsize


def local_nbytes(t: IRTensor, layout: Layout, mesh_shape) -> int:
    split = math.prod(f for f, q in zip(mesh_shape, layout) if isinstance(q, Shard))
    return nbytes(t) // split


def carries_grad(t: IRTensor) -> bool:
    return t.dtype.is_floating_point and t.kind in (PARAM, ACTIVATION)


def step_collectives(t: IRTensor, before: Layout, step, mesh_shape, axis_names, profile: DeviceProfile,
                     bucketed: bool = False) -> list[Collective]:
    """The forward and backward collectives one conversion step of ``t`` (in layout ``before``) issues;
    ``bucketed``: a parameter's gradient sum rides in a shared bucket (it pays its share of latency)."""
    f = mesh_shape[step.axis]
    size = local_nbytes(t, before, mesh_shape) * (f if step.kind in ("all_gather", "all_gather_sum_grad") else 1)
    across = spans_nodes(mesh_shape, step.axis, profile)
    out = []
    share = min(1.0, size / BUCKET_BYTES) if bucketed and step.kind == "grad_all_reduce" else 1.0
    for phase, table in (("forward", _FORWARD), ("backward", _BACKWARD)):
        kind = table.get(step.kind)
        if kind is None or (phase == "backward" and not carries_grad(t)):
            continue
        out.append(Collective(phase, kind, axis_names[step.axis], f, size,
                              runtime_time(kind, size, f, profile, across, share), t.name))
    return out
