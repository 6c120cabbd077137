"""Context parallelism with Llama 3's causal load balancing: ``cp_balanced``, ``hybrid_cp_balanced`` and
``cp_tp_balanced`` (dp x cp x tp, :mod:`nnscaler.policies.cp_mesh`, also each stage's policy of
``pp2_cp_tp_balanced`` and of a cluster plan with ``cp_balanced``).

``cp`` cuts the sequence in W contiguous chunks, so under a causal mask the last rank's queries see
the most keys. Here the sequence is cut in 2W chunks and rank ``r`` holds chunks ``r`` and
``2W-1-r`` (every split of the sequence on the cp axis is a balanced shard, ``D1z``: see
:class:`~nnscaler.dimops.layout.Shard`). The plan is ``cp``'s with the sequence identifier of every
operator marked balanced on the cp axis, so every operator that splits the sequence works on the
rank's pair of chunks; tensors computed whole (rotary tables, causal, sliding-window and document
masks built from positions) are cut to the same pair of chunks by the conversion ``R -> D1z``, keys
and values are all-gathered and put back in sequence order (``D1z -> R``), and their gradients go
back to their owners by the same permutation.
"""
from __future__ import annotations

from dataclasses import replace

from ..config import ComputeConfig, PlanError
from ..ir.graph import INPUT, IRGraph
from ..ir.plan import Plan
from .builtin import cp, hybrid_cp
from .cp_mesh import cp_tp, cp_tp_mesh, refuse_sp_under_cp


def balance(plan: Plan, axis: int, policy: str) -> Plan:
    """``plan`` with the identifier every operator splits on mesh ``axis`` held in the balanced order."""
    parts = {}
    for name, p in plan.partitions.items():
        ident = p.splits[axis][0] if axis < len(p.splits) else None
        parts[name] = p if ident is None else replace(p, balanced=tuple(dict.fromkeys(p.balanced + (ident,))))
    return replace(plan, partitions=parts, policy=policy)


def _check_pieces(graph: IRGraph, ranks: int, policy: str) -> None:
    """Refuse a sequence that does not divide into two chunks per context-parallel rank."""
    first = next((t for t in graph.inputs if t.kind == INPUT and len(t.shape) > 1), None)
    if ranks > 1 and first is not None and first.shape[1] % (2 * ranks):
        raise PlanError(f"{policy}: the sequence ({first.shape[1]} tokens, dim 1 of input {first.name!r}) does not "
                        f"divide into {2 * ranks} chunks (two per context-parallel rank, Llama 3's balanced layout)")


def cp_balanced(graph: IRGraph, config: ComputeConfig) -> Plan:
    """``cp`` with causal load balancing: the sequence in ``2 * plan_ngpus`` chunks, rank ``r``
    holding chunks ``r`` and ``2W-1-r``."""
    _check_pieces(graph, config.plan_ngpus, "cp_balanced")
    return balance(cp(graph, config), 0, "cp_balanced")


def hybrid_cp_balanced(graph: IRGraph, config: ComputeConfig) -> Plan:
    """``hybrid_cp`` (dp x cp) with the cp axis balanced as in :func:`cp_balanced`."""
    plan = hybrid_cp(graph, config)
    _check_pieces(graph, plan.mesh_shape[1], "hybrid_cp_balanced")
    return balance(plan, 1, "hybrid_cp_balanced")


def cp_tp_balanced(graph: IRGraph, config: ComputeConfig) -> Plan:
    """``cp_tp`` (dp x cp x tp) with the cp axis balanced as in :func:`cp_balanced`: attention's heads stay
    split on tp while its queries' sequence holds the rank's pair of chunks on cp."""
    mesh, names = cp_tp_mesh(config)
    refuse_sp_under_cp(config, dict(zip(names, mesh)), "cp_tp_balanced")
    plan = cp_tp(graph, config)
    if "cp" not in names:  # one cp rank: nothing to balance
        return replace(plan, policy="cp_tp_balanced")
    _check_pieces(graph, plan.mesh_shape[names.index("cp")], "cp_tp_balanced")
    return balance(plan, names.index("cp"), "cp_tp_balanced")
