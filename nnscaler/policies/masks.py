"""Masks per chunk under context parallelism: each rank builds its own rows.

A causal, sliding-window or packed-document mask is computed from positions (``arange``, the batch's
document ids) by operators that carry no sequence of the user's tokens, so a cp policy leaves them whole and
the mask is cut to the rank's query rows where attention reads it (``R -> D`` on the cp axis): O(S^2) per
rank, as one device. :func:`rows_per_chunk` moves that cut back to where the mask is made: an operator whose
output every reader wants split on the cp axis along one dim, and which can split that dim's identifier
(spatially: a mask is elementwise in its rows), is planned split there instead, in the readers' order
(contiguous or Llama 3's balanced chunks); then the operators making its inputs are considered in turn, back
to the positions (an ``arange`` of O(S) stays whole and is sliced for free). Each rank then builds O(S^2 / W)
of the mask. Only tensors that carry no gradient move (a mask, a rotary table), so nothing is exchanged. The
policies run it on the cp axis and then on the dp axis (a mask's batch rows, under ``hybrid_cp`` and ``cp_tp``).
"""
from __future__ import annotations

from dataclasses import replace

from ..dimops.grammar import AnnotationError, VALUE
from ..dimops.layout import Replicate, Shard
from ..dimops.partition import check_partition, splittable
from ..ir.graph import IRGraph, IROp, IRTensor
from ..ir.plan import Plan


ASSERT = "aten._assert_tensor_metadata.default"  # a dtype check: it follows the tensor it checks


def _readers(t: IRTensor) -> list[IROp]:
    return [c for c in t.consumers if c.overload != ASSERT]


def _wanted(op: IROp, plan: Plan, x: IRTensor, axis: int) -> list:
    """The placements on ``axis`` every use of ``x`` by ``op`` wants."""
    lay = op.layout(plan.partition(op))
    return [want[axis] if want is not None else None for y, want in zip(op.inputs, lay.inputs) if y is x]


def _one_want(t: IRTensor, plan: Plan, axis: int) -> Shard | None:
    """The plain or balanced shard on ``axis`` every reader of ``t`` wants, or ``None``."""
    readers = _readers(t)
    if not all(c.known for c in readers):
        return None
    wants = [w for c in readers for w in _wanted(c, plan, t, axis)]
    if not wants or len(set(wants)) != 1:
        return None
    w = wants[0]
    return w if isinstance(w, Shard) and w.blocks == 1 else None


def rows_per_chunk(graph: IRGraph, plan: Plan, axis: int) -> Plan:
    """``plan`` with the operators that make a gradient-free tensor every reader cuts on mesh ``axis`` split there
    themselves (module docstring), back towards the positions they are made from."""
    if axis >= len(plan.mesh_shape) or plan.mesh_shape[axis] == 1:
        return plan
    f = plan.mesh_shape[axis]
    grads = graph.carries_grad()
    outputs = {id(t) for t in graph.outputs if isinstance(t, IRTensor)}
    parts = dict(plan.partitions)
    current = replace(plan, partitions=parts)
    for p in reversed(graph.ops):
        if not p.known or p.spec.local is not None or p.name not in parts:
            continue
        part = parts[p.name]
        if part.axis_ids[axis] is not None or len(p.outputs) != 1 or p.outputs[0] is None:
            continue
        t = p.outputs[0]
        if t in grads or id(t) in outputs or not isinstance(p.layout(part).outputs[0][axis], Replicate):
            continue
        want = _one_want(t, current, axis)
        dims = p.bound.outputs[0]
        if want is None or dims is None or want.dim >= len(dims) or len(dims[want.dim]) != 1:
            continue
        ident = dims[want.dim][0]
        if ident not in splittable(p.bound) or p.bound.markers.get(ident) == VALUE or ident in part.axis_ids:
            continue
        new = _split_on(p.bound, part, axis, ident, f, want)
        if new is None or p.layout(new).outputs[0][axis] != want:
            continue
        checks = {c.name: _follow(c, parts.get(c.name), axis, want, f) for c in t.consumers if c.overload == ASSERT}
        if None in checks.values():
            continue
        parts[p.name] = new
        parts.update(checks)
    return current


def _follow(check: IROp, part, axis: int, want: Shard, f: int):
    """A dtype check of a tensor now split as ``want`` on ``axis``, planned to read it so (``None``: it cannot)."""
    dims = check.bound.inputs[0] if check.known and check.bound.inputs else None
    if part is None or dims is None or want.dim >= len(dims) or len(dims[want.dim]) != 1:
        return None
    ident = dims[want.dim][0]
    if part.axis_ids[axis] not in (None, ident) or ident not in splittable(check.bound):
        return None
    return _split_on(check.bound, part, axis, ident, f, want)


def _split_on(bound, part, axis: int, ident: str, f: int, want: Shard):
    """``part`` with ``ident`` split ``f`` ways on ``axis`` (balanced as ``want`` is), or ``None`` where ``bound`` refuses it."""
    splits = list(part.splits)
    splits[axis] = (ident, f)
    new = replace(part, splits=tuple(splits),
                  balanced=part.balanced + ((ident,) if want.balanced and ident not in part.balanced else ()))
    try:
        check_partition(bound, new)
    except AnnotationError:
        return None
    return new
