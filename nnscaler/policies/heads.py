"""Attention by heads for ``tp``, where the layout-following greedy misses it.

The greedy (:mod:`nnscaler.policies.greedy`) sees one operator at a time. When the hidden stream
reaching the q/k/v projections is already split along the hidden dim (a post-norm model's
residual stream, a vocabulary-parallel embedding's reduce-scatter), a row split of the projection
is locally cheapest; its output is summed whole, and everything after it (QK-norm, rotary,
attention) stays whole on every rank (OLMo-2/3, FlexOlmo: 0 of 2 layers by heads).

Megatron's plan is fixed by the attention: heads split, and that split carried back to the
column-split projections. :func:`pin_heads` walks back from each attention-score operator left
whole (softmax or sdpa; heads are dim 1 of its 4-d output) along the dims that carry the heads
identifier, through views, transposes, rotary and norms' element-wise steps, to the operators
whose heads identifier names a parameter's dim (the projections) or a graph input, pinning each
operator on the way to that identifier. A norm's statistic over the split hidden dim is not on
the path (its input lacks the heads dim after the reduction): the greedy then takes the
statistic's ``+`` split (a partial sum, one small all-reduce), Megatron's way for QK-norm over the
whole projection. An attention whose walk meets an operator that cannot split its heads (not
splittable, not divisible by the degree, or already pinned otherwise) is left as it was.
"""
from __future__ import annotations

from ..dimops.partition import splittable
from ..ir.graph import IRGraph, IROp, IRTensor

ATTENTION = ("softmax", "scaled_dot_product_attention")


def scores(graph: IRGraph) -> list[IROp]:
    """Attention-score operators: softmax and sdpa with a 4-d output (batch, heads, q, k)."""
    return [op for op in graph.ops if op.known and op.outputs and op.outputs[0] is not None
            and len(op.outputs[0].shape) == 4 and any(a in op.overload for a in ATTENTION)]


def _lead(ids: tuple[str, ...]) -> str | None:
    """The identifier a dim splits on (its first factor that is not a number)."""
    return next((i for i in ids if not i.isdigit()), None)


def _walk(op: IROp, degree: int, pins: dict[str, str]) -> dict[str, str] | None:
    """Pins for one attention: ``op``'s output 0 split on dim 1, carried back to the operators that
    make its inputs and on to those that use its outputs, wherever a tensor holds the heads dim;
    ``None`` if an operator on the way cannot take it."""
    out: dict[str, str] = {}
    todo: list[tuple[IROp, str]] = [(op, op.bound.outputs[0][1] and _lead(op.bound.outputs[0][1]))]
    while todo:
        p, ident = todo.pop()
        if p.name in out:
            continue
        if ident is None or ident not in splittable(p.bound) or p.bound.sizes[ident] % degree:
            return None
        if pins.get(p.name, ident) != ident:
            return None
        out[p.name] = ident
        for x, dims in zip(p.inputs, p.bound.inputs):  # back to the producers (parameters: stored split)
            if isinstance(x, IRTensor) and dims is not None and x.producer is not None:
                for k, ids in enumerate(dims):
                    if _lead(ids) == ident:
                        todo.append(_from_output(x.producer, x, k))
        for t, dims in zip(p.outputs, p.bound.outputs):  # on to the readers
            if t is not None and dims is not None:
                for k, ids in enumerate(dims):
                    if _lead(ids) == ident:
                        todo += [_from_input(c, t, k) for c in t.consumers]
    return out


def _from_output(p: IROp, t: IRTensor, d: int) -> tuple[IROp, str | None]:
    if not p.known:
        return p, None
    j = next(k for k, o in enumerate(p.outputs) if o is t)
    dims = p.bound.outputs[j]
    return p, (_lead(dims[d]) if dims is not None and d < len(dims) else None)


def _from_input(c: IROp, t: IRTensor, d: int) -> tuple[IROp, str | None]:
    if not c.known:
        return c, None
    for x, dims in zip(c.inputs, c.bound.inputs):
        if x is t and dims is not None and d < len(dims):
            return c, _lead(dims[d])
    return c, None


def pin_heads(graph: IRGraph, degree: int, whole: list[IROp]) -> dict[str, str]:
    """Operator name -> the heads identifier it must split on, for the attentions in ``whole``."""
    pins: dict[str, str] = {}
    for op in whole:
        got = _walk(op, degree, pins)
        if got:
            pins.update(got)
    return pins


def heads_split(op: IROp, plan) -> bool:
    """Whether ``plan`` splits the attention-score operator ``op`` on its heads (dim 1)."""
    from ..dimops.layout import Shard
    lay = op.layout(plan.partition(op)).outputs[0] or ()
    return any(isinstance(q, Shard) and q.dim == 1 for q in lay)
