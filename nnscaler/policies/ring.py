"""Context parallelism by ring exchange: ``cp_ring``, ``cp_ring_balanced``, ``cp_tp_ring``, ``cp_tp_ring_balanced``.

The all-gather scheme (``cp``) keeps attention's annotation (keys ``t^`` whole, so a split of the
queries' sequence all-gathers them). The ring scheme chooses another annotation for each self-attention:
:func:`ring_sites` rebinds it to one operator, ``ring.scaled_dot_product_attention``, whose queries,
keys and values all carry the sequence ``s`` (a mask: its rows ``s``, its key columns ``t^`` whole),
run by the partition-aware kernel :func:`nnscaler.runtime.ring.ring_attention` that exchanges keys and
values around the ring of the ranks splitting ``s``. An attention is

* ``scaled_dot_product_attention`` of 4-d q, k, v of one length, no dropout (grouped query heads with
  ``enable_gqa``; its mask, ``is_causal`` and scale become the kernel's score mods), or
* eager attention: ``q @ k^T``, scales (``mul``/``div`` by a number), an additive mask (``add``) or a
  ``masked_fill``, ``softmax`` over the keys, dtype casts, a dropout of 0 and ``@ v`` (transformers' eager
  attention, a hand-written one), every step read by the next only (dtype asserts on the way dropped).

Other attentions keep their operators, and their all-gather, which :func:`ring_note` names. Unsplit, the
kernel is plain attention, so the rebinding changes what ranks exchange, never what the program computes.
The policies rebind the graph they are given in place, then plan as ``cp``, ``cp_balanced`` or ``cp_tp`` do;
the kernel reads the balanced order from its :class:`~nnscaler.runtime.partitioned.ShardContext`. In place is
the contract of a policy that rewrites (:data:`nnscaler.ir.plan.Policy`): the plan names the ring operators,
which exist only in the rebound graph, and the compiler compiles the graph it handed the policy (its own trace
or a copy of a cached one); a copy here would leave the caller a graph the plan does not fit. Rebinding is
idempotent (:func:`ring_sites` counts the ring operators already there), so planning one graph twice is safe;
a caller planning one graph under other policies too gives the ring a copy (``IRGraph.copy``).
"""
from __future__ import annotations

import math
from functools import partial

import torch

from ..config import ComputeConfig, PlanError
from ..dimops.binding import bind
from ..ir.graph import PARAM, IRGraph, IROp, IRTensor
from ..ir.plan import Plan
from ..ops.spec import OpSpec
from ..runtime.ring import attention, ring_attention
from .builtin import cp
from .context import balance, cp_balanced

OVERLOAD = "ring.scaled_dot_product_attention"
_SDPA = "aten.scaled_dot_product_attention.default"
_MATMUL = ("aten.matmul.default",)
_CASTS = ("aten.to.dtype", "aten._to_copy.default", "aten.to.dtype_layout", "aten.type_as.default")
_ASSERT = "aten._assert_tensor_metadata.default"


def _only(t: IRTensor) -> IROp | None:
    """The one consumer of ``t`` that is not a dtype assert (``None`` when there are several)."""
    users = [c for c in t.consumers if c.overload != _ASSERT]
    return users[0] if len(users) == 1 else None


def _eager(mm: IROp, outputs: set, grads: set):
    """``(ops, q, kT, v, masks, mods)`` when ``mm`` (``q @ k^T``) starts an eager attention (see the
    module docstring), else ``None``."""
    q, kt = mm.inputs[:2]
    if not (isinstance(q, IRTensor) and isinstance(kt, IRTensor) and len(q.shape) == 4 == len(kt.shape)):
        return None
    if q.shape[-2] != kt.shape[-1] or q.shape[:2] != kt.shape[:2] or q.shape[-1] != kt.shape[-2]:
        return None
    ops, masks, mods, x, soft = [mm], [], [], mm.outputs[0], False
    while True:
        if x in outputs:
            return None
        nxt = _only(x)
        if nxt is None:
            return None
        ops.append(nxt)
        ov, args = nxt.overload, nxt.inputs
        if ov in _MATMUL:
            v = args[1]
            if not soft or args[0] is not x or not isinstance(v, IRTensor) or v.shape[:-1] != q.shape[:-1]:
                return None
            return ops, q, kt, v, masks, tuple(mods)
        if args[0] is not x:
            return None
        if not soft and ov in ("aten.mul.Tensor", "aten.div.Tensor") and isinstance(args[1], (int, float)):
            mods.append(("mul" if "mul" in ov else "div", float(args[1])))
        elif not soft and ov == "aten.add.Tensor" and isinstance(args[1], IRTensor) and _maskable(args[1], x, grads):
            mods.append(("add", len(masks)))
            masks.append(args[1])
        elif not soft and ov == "aten.masked_fill.Scalar" and isinstance(args[1], IRTensor) and _maskable(args[1], x, grads):
            mods.append(("fill", len(masks), float(args[2])))
            masks.append(args[1])
        elif not soft and ov in ("aten.softmax.int", "aten._softmax.default") and args[1] in (-1, 3):
            soft = True
        elif soft and (ov in _CASTS or (ov == "aten.dropout.default" and args[1] == 0.0)):
            pass
        else:
            return None
        x = nxt.outputs[0]


def learned(graph: IRGraph) -> set[IRTensor]:
    """Floating tensors computed from a parameter through differentiable operators: a score bias made of
    them (T5's relative positions, ALiBi slopes that learn) is not a mask, since the kernel gives masks no
    gradient. (Tensors read from the batch or from an earlier pipeline stage count as masks.)"""
    out = {t for t in graph.params if t.dtype.is_floating_point}
    for op in graph.ops:
        if (op.spec is None or op.spec.differentiable) and any(x in out for x in op.tensor_inputs()):
            out.update(t for t in op.outputs if t is not None and t.dtype.is_floating_point)
    return out


def _maskable(m: IRTensor, scores: IRTensor, grads: set[IRTensor] = frozenset()) -> bool:
    """A mask of the scores that needs no gradient (not in ``grads``, :func:`learned`) and broadcasts from
    the right: key columns whole."""
    if m.kind == PARAM or m in grads:
        return False
    n = len(scores.shape)
    return (len(m.shape) <= n and m.shape[-1] == scores.shape[-1]
            and all(a in (1, b) for a, b in zip(m.shape[::-1], scores.shape[::-1])))


def _sdpa(op: IROp, grads: set):
    """``(ops, q, k, v, masks, mods)`` for a self-attention ``scaled_dot_product_attention`` the kernel runs."""
    if op.overload != _SDPA or not op.known:
        return None
    q, k, v = op.inputs[:3]
    rest = list(op.inputs[3:]) + [None] * 4
    mask = op.kwargs.get("attn_mask", rest[0])
    dropout, causal = op.kwargs.get("dropout_p", rest[1] or 0.0), op.kwargs.get("is_causal", rest[2] or False)
    scale = op.kwargs.get("scale", rest[3])
    if dropout or not all(isinstance(t, IRTensor) and len(t.shape) == 4 for t in (q, k, v)):
        return None
    gqa = op.kwargs.get("enable_gqa", False) and q.shape[1] != k.shape[1] and q.shape[1] % k.shape[1] == 0
    if k.shape[-2] != q.shape[-2] or k.shape[-1] != q.shape[-1] or v.shape[:-1] != k.shape[:-1] \
            or k.shape[0] != q.shape[0] or (k.shape[1] != q.shape[1] and not gqa):
        return None
    mods: list = [("mul", float(scale if scale is not None else 1 / math.sqrt(q.shape[-1])))]
    masks = []
    if isinstance(mask, IRTensor):
        if not _maskable(mask, IRTensor("scores", q.shape[:-1] + (k.shape[-2],), q.dtype), grads):
            return None
        mods.append(("keep", 0) if mask.dtype == torch.bool else ("add", 0))
        masks.append(mask)
    if causal:
        mods.append(("causal",))
    return [op], q, k, v, masks, tuple(mods)


def _annotation(q: IRTensor, k: IRTensor, masks: list[IRTensor], keys_transposed: bool) -> str:
    """Queries, keys, values and masks on one sequence ``s`` (a mask's key columns ``t^`` whole); grouped
    query heads ``(h g)`` over the key heads ``h``."""
    heads = "(h g)" if q.shape[1] != k.shape[1] else "h"
    lead = ["b", heads]
    k = "b h d^ s" if keys_transposed else "b h s d^"
    ms = []
    for m in masks:
        full = lead + ["s", "t^"]
        dims = [full[len(full) - len(m.shape) + i] if n != 1 else "1" for i, n in enumerate(m.shape)]
        ms.append(" ".join(dims))
    return ", ".join([f"b {heads} s d^", k, "b h s e", *ms]) + f" -> b {heads} s e"


def _fuse(graph: IRGraph, found, index: int) -> IROp:
    ops, q, k, v, masks, mods = found
    kt = ops[0].overload in _MATMUL
    anno = _annotation(q, k, masks, kt)
    kw = {"mods": mods, "keys_transposed": kt}
    spec = OpSpec.create("ring_attention", anno, partial(attention, **kw), family="nn",
                         local=partial(ring_attention, ident="s", **kw), exchange=(("s", (1, 2)),),
                         doc="attention over a split sequence, keys and values exchanged around the ring")
    inputs = [q, k, v, *masks]
    out = ops[-1].outputs[0]
    bound = bind(spec.anno, [t.shape for t in inputs], [out.shape])
    last = ops[-1]
    new = IROp(f"ring_attention{'_' + str(index) if index else ''}", OVERLOAD, inputs, [out], spec=spec, bound=bound,
               source=last.source, scope=last.scope, scope_types=last.scope_types, checkpoint=last.checkpoint)
    gone = set(map(id, ops))
    asserts = [c for o in ops for t in o.outputs if t is not None and t is not out for c in t.consumers if c.overload == _ASSERT]
    gone |= set(map(id, asserts))
    for t in {id(t): t for o in ops + asserts for t in o.tensor_inputs()}.values():
        t.consumers = [c for c in t.consumers if id(c) not in gone]
    for t in inputs:
        t.consumers.append(new)
    out.producer = new
    at = graph.ops.index(last)
    graph.ops[at] = new
    graph.ops[:] = [o for o in graph.ops if id(o) not in gone or o is new]
    return new


def ring_sites(graph: IRGraph) -> list[IROp]:
    """Rebind every attention the ring kernel runs (module docstring) to one ring operator; returns them
    (those already rebound included)."""
    outputs = {t for t in graph.outputs if isinstance(t, IRTensor)}
    grads = learned(graph)
    done = [op for op in graph.ops if op.overload == OVERLOAD]
    for op in list(graph.ops):
        if op not in graph.ops:
            continue
        found = _sdpa(op, grads) if op.overload == _SDPA else (_eager(op, outputs, grads) if op.overload in _MATMUL else None)
        if found is not None:
            done.append(_fuse(graph, found, len(done)))
    return done


def ring_note(graph: IRGraph, policy: str) -> str:
    """Rebind (:func:`ring_sites`) and say what stays all-gathered; a graph with no attention to ring is refused."""
    sites = ring_sites(graph)
    if not sites:
        raise PlanError(f"{policy}: no self-attention the ring kernel runs (sdpa of one length without dropout, or "
                        f"eager q @ k^T, scale, mask, softmax, @ v); use cp or cp_balanced (all-gather)")
    left = [op.name for op in graph.ops if op.known and op.overload == _SDPA]
    return f"{policy}: {len(sites)} attention(s) on the ring" + (f"; all-gathered: {', '.join(left)}" if left else "")


def _noted(plan: Plan, note: str, policy: str) -> Plan:
    plan.policy, plan.note = policy, note
    return plan


def cp_ring(graph: IRGraph, config: ComputeConfig) -> Plan:
    """``cp`` (contiguous chunks) with attention's keys and values exchanged around the ring."""
    note = ring_note(graph, "cp_ring")
    return _noted(cp(graph, config), note, "cp_ring")


def cp_ring_balanced(graph: IRGraph, config: ComputeConfig) -> Plan:
    """``cp_balanced`` (rank r: chunks r and 2W-1-r) with the ring exchange."""
    note = ring_note(graph, "cp_ring_balanced")
    return _noted(cp_balanced(graph, config), note, "cp_ring_balanced")


def cp_tp_ring(graph: IRGraph, config: ComputeConfig) -> Plan:
    """``cp_tp`` (dp x cp x tp, heads on tp) with the ring on the cp axis."""
    from .cp_mesh import cp_tp
    note = ring_note(graph, "cp_tp_ring")
    return _noted(cp_tp(graph, config), note, "cp_tp_ring")


def cp_tp_ring_balanced(graph: IRGraph, config: ComputeConfig) -> Plan:
    """``cp_tp_ring`` with the cp axis in the balanced order."""
    from .cp_mesh import cp_tp_mesh, refuse_sp_under_cp
    mesh, names = cp_tp_mesh(config)
    refuse_sp_under_cp(config, dict(zip(names, mesh)), "cp_tp_ring_balanced")
    plan = cp_tp_ring(graph, config)
    if "cp" not in plan.axis_names:
        return plan
    axis = plan.axis_names.index("cp")
    n = plan.mesh_shape[axis]
    first = next((t for t in graph.inputs if t.kind == "input" and len(t.shape) > 1), None)
    if first is not None and first.shape[1] % (2 * n):
        raise PlanError(f"cp_tp_ring_balanced: the sequence ({first.shape[1]} tokens) does not divide into {2 * n} chunks")
    return _noted(balance(plan, axis, "cp_tp_ring_balanced"), plan.note, "cp_tp_ring_balanced")
