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
whole projection. An attention whose score operator, or an operator after it, cannot split its
heads (not splittable, not divisible by the degree, or already pinned otherwise) is left as it was.

Megatron's rule where the heads cannot be carried further back: the path upstream stays whole on
every rank (computed replicated, its projection not split) and the heads are split where they
first can be, a local slice of a whole tensor, no collective. Two such places:

- fewer key/value heads than ranks (MQA, GQA with kv < W): ``repeat_kv``'s expand or the reshape
  merging kv heads x repeats (``(b c)``, ``b`` not divisible by the degree), or a score matmul
  broadcasting one kv head over the query heads (``a 1 k n``: Falcon), is reached; every operator
  on the key/value path back to its projection is pinned whole (:func:`_whole`), where the greedy
  alone would split the head width and gather it again before rotary (two collectives per layer);
- a fused projection cut in unequal q|k|v slices (Falcon's ``[..., :-2, :]``, Phi-3's
  ``qkv[..., :q]``): the slice cannot split the heads of its cut dim, so the fused projection stays
  whole and each slice's heads are split after it. Splitting the fused weight in each slice's own
  blocks would need a layout of unequal blocks, which :mod:`nnscaler.dimops.layout` does not have
  (its blocks are equal).

Attention written with ``bmm`` merges the heads into the batch (``view(b*h, s, d)``: 3-d scores).
The walk then carries the heads as the inner factor of that merged dim: an operator reading it
whole splits it in ``b`` blocks (the greedy follows the blocks its input holds), a reshape
writing it ``(b h)`` splits ``h`` (:mod:`nnscaler.dimops.partition`).
"""
from __future__ import annotations

from ..dimops.partition import splittable
from ..dimops.grammar import VALUE
from ..ir.graph import BUFFER, CONSTANT, INPUT, PARAM, IRGraph, IROp, IRTensor

ATTENTION = ("softmax", "scaled_dot_product_attention")


def scores(graph: IRGraph) -> list[IROp]:
    """Attention-score operators: softmax and sdpa with a 4-d output (batch, heads, q, k), or a 3-d
    one whose dim 0 is the batch and the heads merged, ``(b h)`` (``bmm`` attention, as BART's
    generation of models and ``F.multi_head_attention_forward`` write it)."""
    return [op for op in graph.ops if op.known and op.outputs and op.outputs[0] is not None
            and len(op.outputs[0].shape) in (3, 4) and any(a in op.overload for a in ATTENTION)
            and op.outputs[0].shape[-1] > 1]


def _lead(ids: tuple[str, ...]) -> str | None:
    """The identifier a dim splits on (its first factor that is not a number)."""
    return next((i for i in ids if not i.isdigit()), None)


def _heads_of(ids: tuple[str, ...], merged: bool) -> tuple[str | None, bool]:
    """The identifier an operator splits the heads on, on a dim written ``ids`` of a tensor that
    holds the heads (``merged``: as the inner factor of batch x heads), and whether that identifier
    still names the merged dim: ``(b h)`` gives ``h``, a plain dim its one identifier."""
    if merged:
        return (ids[0], True) if len(ids) == 1 else (ids[-1], False)
    return _lead(ids), False


def _carries(ids: tuple[str, ...], ident: str, merged: bool) -> bool | None:
    """Whether a tensor dim written ``ids`` holds the heads an operator splits as ``ident``: ``None``
    if not, else whether it holds them merged into the batch (``(b h)``, ``h`` its last factor)."""
    if ident not in ids:
        return None
    j = ids.index(ident)
    if len(ids) == 1:
        return merged
    if j == 0 or _lead(ids) == ident:
        return None if merged else False
    return None if merged or j != len(ids) - 1 else True


def weights_only(graph: IRGraph) -> set[IRTensor]:
    """Tensors computed from parameters, buffers and constants alone (a bias ``cat`` of q, k and v's
    biases): whole on every rank at no cost, so a split of one is a local slice."""
    out: set[IRTensor] = set()
    for op in graph.ops:
        if all(x.kind in (PARAM, BUFFER, CONSTANT) or x in out for x in op.tensor_inputs()):
            out.update(t for t in op.outputs if t is not None)
    return out


def _walk(op: IROp, degree: int, pins: dict[str, str | None], weights: set[IRTensor] = frozenset()
          ) -> dict[str, str | None] | None:
    """Pins for one attention: ``op``'s output 0 split on its heads (dim 1 of 4-d scores, the inner
    factor of dim 0 of 3-d ones), carried back to the operators that make its inputs and on to
    those that use its outputs, wherever a tensor holds the heads dim; ``None`` if ``op`` or an
    operator after it cannot take it, or the batch x heads dim of 3-d scores reaches a program input
    or a parameter (then dim 0 was never heads merged into the batch). A producer that cannot take
    the heads, and the key/value path an operator broadcasts over the heads (``1`` where its output
    holds them: one kv head, ``repeat_kv``'s expand), are pinned whole back to their projections
    (``None``: :func:`_whole`). A branch back into tensors made from ``weights`` alone is pinned
    where it can be and left to the greedy where it cannot (the split reader slices what it needs)."""
    out: dict[str, str | None] = {}
    roots: list[IROp] = []
    dims0 = op.bound.outputs[0]
    start = _heads_of(dims0[1], False) if len(dims0) == 4 else _heads_of(dims0[0], True)
    todo: list[tuple[IROp, str | None, bool, bool, bool]] = [(op, *start, False, False)]
    while todo:
        p, ident, merged, optional, back = todo.pop()
        if p.name in out:
            continue
        if (ident is None or ident not in splittable(p.bound) or p.bound.sizes[ident] % degree
                or pins.get(p.name, ident) != ident):
            if optional:
                continue
            if back and p.known and pins.get(p.name) is None:  # heads split after it: it and its inputs stay whole
                roots += [p] if p.name not in pins else []
                continue
            return None
        out[p.name] = ident
        for x, dims in zip(p.inputs, p.bound.inputs):  # back to the producers (parameters: stored split)
            if isinstance(x, IRTensor) and dims is not None:
                if x.producer is not None and x not in weights and _broadcasts(p, dims, ident, merged):
                    roots.append(x.producer)  # one kv head for all query heads: kept whole
                for k, ids in enumerate(dims):
                    held = _carries(ids, ident, merged)
                    if held is None:
                        continue
                    if x.producer is None:
                        if held:
                            return None
                        continue
                    todo.append((*_from_output(x.producer, x, k, held), optional or x in weights, True))
        for t, dims in zip(p.outputs, p.bound.outputs):  # on to the readers
            if t is not None and dims is not None:
                for k, ids in enumerate(dims):
                    held = _carries(ids, ident, merged)
                    if held is not None:
                        todo += [(*_from_input(c, t, k, held), optional, False) for c in t.consumers]
    whole = _whole(roots, {**pins, **out}, weights)
    if whole is None:
        return None
    return {**out, **whole}


def _broadcasts(p: IROp, dims, ident: str, merged: bool) -> bool:
    """Whether an input of ``p`` written ``dims`` is broadcast over the heads ``p`` splits as
    ``ident``: a ``1`` where ``p``'s output 0 holds them (right-aligned), as the one kv head of
    multi-query attention in a score matmul, or ``repeat_kv``'s expand of each kv head."""
    outs = p.bound.outputs[0] if p.bound.outputs else None
    if merged or not outs or len(dims) != len(outs):
        return False
    return any(_carries(o, ident, False) is not None and i == ("1",) for i, o in zip(dims, outs))


WHOLE_LIMIT = 256
"""The most operators one attention's whole key/value path may hold (a walk past it, not ending at
projections, leaves the attention as the greedy planned it)."""


def _matrix(x: IRTensor, weights: set[IRTensor]) -> bool:
    """Whether ``x`` is a weight matrix: a parameter of 2 or more dims, or made from one alone (its
    transpose); not a table made from buffers (rotary cos/sin)."""
    if len(x.shape) < 2:
        return False
    if x.kind == PARAM:
        return True
    return x in weights and x.producer is not None and any(_matrix(y, weights) for y in x.producer.tensor_inputs())


def _projection(op: IROp, weights: set[IRTensor]) -> bool:
    """An operator with a weight matrix (a projection, an embedding): a whole path ends there."""
    return any(isinstance(x, IRTensor) and _matrix(x, weights) for x in op.inputs)


def _whole(roots: list[IROp], taken: dict[str, str | None], weights: set[IRTensor]) -> dict[str, None] | None:
    """``roots`` and the operators that make their inputs, back to the projections (included, with
    the operators that make their weights: a transpose of the matrix), pinned whole; operators
    ``taken`` already keep their pins. ``None`` past :data:`WHOLE_LIMIT`."""
    out: dict[str, None] = {}
    todo = list(roots)
    while todo:
        p = todo.pop()
        if p.name in out or p.name in taken or not p.known:
            continue
        out[p.name] = None
        if len(out) > WHOLE_LIMIT:
            return None
        stop = _projection(p, weights)
        todo += [x.producer for x in p.tensor_inputs() if x.producer is not None and (x in weights or not stop)]
    return out


def _from_output(p: IROp, t: IRTensor, d: int, merged: bool) -> tuple[IROp, str | None, bool]:
    if not p.known:
        return p, None, merged
    j = next(k for k, o in enumerate(p.outputs) if o is t)
    dims = p.bound.outputs[j]
    return (p, *_heads_of(dims[d], merged)) if dims is not None and d < len(dims) else (p, None, merged)


def _from_input(c: IROp, t: IRTensor, d: int, merged: bool) -> tuple[IROp, str | None, bool]:
    if not c.known:
        return c, None, merged
    for x, dims in zip(c.inputs, c.bound.inputs):
        if x is t and dims is not None and d < len(dims):
            return (c, *_heads_of(dims[d], merged))
    return c, None, merged


def pin_heads(graph: IRGraph, degree: int, whole: list[IROp]) -> dict[str, str | None]:
    """Operator name -> the heads identifier it must split on (``None``: kept whole), for the
    attentions in ``whole``."""
    pins: dict[str, str | None] = {}
    weights = weights_only(graph)
    for op in whole:
        got = _walk(op, degree, pins, weights)
        if got:
            pins.update(got)
    return pins


PROJECTED_LIMIT = 4096
"""The most (operator, identifier) steps :func:`projected` takes back from one score dim."""


def projected(op: IROp, d: int) -> bool:
    """Whether dim ``d`` of ``op``'s output 0 holds heads by where it comes from: its identifier, followed back
    through the operators that make it (as a dim, or as the inner factor of a batch x heads one), reaches
    the output features of a projection (a dim of a weight matrix that the operator contracts with its
    input: linear's ``n`` beside ``k+``) and never a program input (the batch and the tokens come from
    there). Longformer's sliding-chunk scores are (batch, queries, heads, window): heads at dim 2."""
    dims = op.bound.outputs[0] if op.known and op.bound.outputs else None
    if dims is None or d >= len(dims):
        return False
    todo, seen, found = [(op, *_heads_of(dims[d], False))], set(), False
    while todo:
        p, ident, merged = todo.pop()
        if ident is None or (p.name, ident, merged) in seen or not p.known:
            continue
        seen.add((p.name, ident, merged))
        if len(seen) > PROJECTED_LIMIT:
            return False
        contracts = any(p.bound.markers.get(i) == VALUE for i in p.bound.sizes)
        for x, xdims in zip(p.inputs, p.bound.inputs):
            if not isinstance(x, IRTensor) or xdims is None:
                continue
            for k, ids in enumerate(xdims):
                held = _carries(ids, ident, merged)
                if held is None:
                    continue
                if x.kind == INPUT:
                    return False
                if x.kind == PARAM:
                    found |= contracts and len(x.shape) >= 2
                elif x.producer is not None:
                    todo.append(_from_output(x.producer, x, k, held))
    return found


def heads_split(op: IROp, plan) -> bool:
    """Whether ``plan`` splits the attention-score operator ``op`` on its heads: a dim between the
    batch and the (queries, keys) pair (dim 1 of 4-d scores; 2 of 5-d ones, ProphetNet's n-gram
    streams x heads), dim 0 of 3-d ones in blocks (the heads inside each batch row of ``(b h)``), or
    any dim between the batch and the keys that holds heads by where it comes from (:func:`projected`:
    Longformer's queries come before its heads)."""
    from ..dimops.layout import Shard
    lay = op.layout(plan.partition(op)).outputs[0] or ()
    n = len(op.outputs[0].shape)
    return any(isinstance(q, Shard) and (0 < q.dim < n - 2 or (n == 3 and q.dim == 0 and q.blocks > 1)
                                         or (0 < q.dim < n - 1 and projected(op, q.dim))) for q in lay)
