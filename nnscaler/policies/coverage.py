"""Operators a plan leaves whole on every rank: those without an annotation, and those whose
partition splits nothing although the plan has several ranks."""
from __future__ import annotations

from ..ir.graph import IRGraph


def replicated_operators(graph: IRGraph, plan) -> list[tuple[str, str, str]]:
    """``(op name, overload, reason)`` for every operator each rank runs whole."""
    if plan.world_size == 1:
        return []
    out = []
    for op in graph.ops:
        if not op.known:
            out.append((op.name, op.overload, "no annotation"))
        elif plan.partition(op).degree == 1:
            out.append((op.name, op.overload, "partition splits nothing"))
    return out
