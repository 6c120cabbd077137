"""Which operators a plan leaves whole on every rank although they work on data: the operators
without an annotation (their inputs are gathered whole), and annotated ones that could be split
but that the plan replicates. Operators that read no data (``arange``, ``zeros``, masks and
positions derived from them, casts of parameters: every tensor input is a parameter, buffer,
constant or such an operator's result) are not counted: every rank computes them locally with no
communication.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..cost.summary import replicated_listing
from ..dimops.partition import splittable
from ..ir.graph import GUARD, IRGraph, IROp
from ..ir.plan import Plan



@dataclass(frozen=True)
class Replicated:
    """One operator the plan replicates: why (``unknown``: no annotation, no rule; ``indivisible``:
    annotated, but no splittable dim's length divides a mesh axis; ``whole``: annotated and
    divisible, yet the policy kept it whole, as cheaper whole on its profile or not a dim the
    policy splits), and the model line that made it."""

    op: IROp
    reason: str

    def __str__(self) -> str:
        where = f" at {self.op.source}" if self.op.source else ""
        return f"{self.op.name} ({self.op.overload}, {self.reason}){where}"


def replicated_operators(graph: IRGraph, plan: Plan) -> list[Replicated]:
    """The operators of ``graph`` that ``plan`` runs whole on every rank, in program order."""
    out = []
    local = {id(t) for t in graph.params + graph.buffers}
    for op in graph.ops:
        if op.overload == GUARD:  # a check the trace added (plan.stats.guards), not an operator of the model
            continue
        if all(id(t) in local for t in op.tensor_inputs()):
            local.update(id(t) for t in op.outputs if t is not None)
            continue
        if not op.known:
            out.append(Replicated(op, "unknown"))
        elif plan.partition(op).degree == 1 and (ids := splittable(op.bound)):
            axes = [n for n in plan.mesh_shape if n > 1]
            fits = any(op.bound.sizes[i] % n == 0 for i in ids for n in axes)
            out.append(Replicated(op, "whole" if fits else "indivisible"))
    return out


def replicated_line(graph: IRGraph, plan: Plan) -> str:
    """``N of M operators replicated: overload xK (reason), ...`` in one line."""
    reps = replicated_operators(graph, plan)
    listing = replicated_listing([(r.op.name, r.op.overload, r.reason) for r in reps])
    return f"{len(reps)} of {len(graph.ops)} operators replicated" + (f": {listing}" if listing else "")
