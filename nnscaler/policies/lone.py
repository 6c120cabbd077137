"""Column splits with no row partner, for ``tp``: a projection whose split output dim an operator
reads whole (a layer norm, a softmax, a top-k: frozen there) before any weight matrix contracts it,
or a down projection (fewer outputs than inputs) whose split output dim a norm's statistics reduce.

Megatron splits a weight matrix by columns only to pair it with a row-parallel one (or attention by
heads) that contracts the split; a projection whose output a norm or a router's top-k reads whole
stays whole on every rank ("duplicated": DeepSeek's MLA down projections ahead of their RMS norms, a
router). Split by columns, it costs a collective per use where it has no partner: an all-gather of
its output for a norm (Swin's patch merging and patch embedding ahead of their layer norms), or a
row-parallel partner after the norm all-reducing what was small), or one added to a stream it does not
make (a shared expert's down projection, left column-split after a gate and up kept whole, added to the
residual stream: the stream split by hidden to the end, each norm after it all-reducing its statistics
and the head gathering it back). A widening projection whose split
output a norm's statistics reduce on the way to its partner keeps its split (BitNet's sub-norms
between column and row: the statistics all-reduced, one small collective). The cross-entropy loss is
not such a reader: Megatron's vocabulary-parallel loss reads its logits split, nor is a cut of the dim into
parts (a fused projection's ``split_with_sizes``/``slice``: Mamba-2's z | xBC | dt): each part is followed to
its own readers. A sum of two paths of the projection itself (a chunked scan's diagonal and off-diagonal
blocks, however long) is no residual stream it does not make. Attention stays
Megatron's: :func:`nnscaler.policies.heads.pin_heads` pins the projections by heads (QK-norm over the
whole projection then all-reduces its statistics), whatever this rule says.
"""
from __future__ import annotations

import math

from ..dimops.grammar import FROZEN
from ..dimops.partition import split_factor
from ..ir.graph import BUFFER, CONSTANT, INPUT, PARAM, IRGraph, IROp, IRTensor

DEPTH = 24  # operators followed from a projection's output (views, element-wise math, residual adds)
# projections whose output dims a weight's rows name (experts' kernels tie their experts to the tokens: no columns)
DENSE = ("aten.linear.default", "aten.addmm.default", "aten.mm.default", "aten.matmul.default", "aten.convolution.default",
         "aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default")
ADDS = ("aten.add.Tensor", "aten.sub.Tensor", "aten.add_.Tensor")
STORED = (PARAM, BUFFER, CONSTANT)
LOSS = ("aten.cross_entropy_loss.default", "aten.nll_loss_nd.default", "aten.nll_loss.default")
# cuts of a dim into parts and joins of parts (a fused projection's slices: Mamba's z|xBC|dt, Qwen3-Next's
# q|k|v|z cut and q|k|v joined again for its conv): no reader of the whole
CUTS = ("aten.split_with_sizes.default", "aten.split.Tensor", "aten.slice.Tensor", "aten.select.int",
        "aten.narrow.default", "aten.chunk.default", "aten.unbind.int", "aten.cat.default")


def _weight_matrix(op: IROp) -> bool:
    return any(isinstance(x, IRTensor) and x.kind == PARAM and len(x.shape) >= 2 for x in op.inputs)


def lone_columns(graph: IRGraph) -> dict[str, set[str]]:
    """Per weight-matrix operator, the output identifiers (columns) whose split would be reduced
    whole, by an operator with no weight matrix, before a weight matrix contracts it."""
    out: dict[str, set[str]] = {}
    for op in graph.ops:
        if not op.known or op.overload not in DENSE or not _weight_matrix(op) or not op.outputs or op.outputs[0] is None:
            continue
        dims = op.bound.outputs[0]
        params = {i for x, d in zip(op.inputs, op.bound.inputs)
                  if isinstance(x, IRTensor) and x.kind == PARAM and d for ids in d for i in ids}
        for d, ids in enumerate(dims or ()):
            i = split_factor(ids, 1, op.bound)
            why = _reduced_whole(op.outputs[0], d) if i in params else None
            if why == "whole" or why == "reduced" and _narrowing(op):
                out.setdefault(op.name, set()).add(i)
    return out


def _made_from(y: IRTensor, t: IRTensor) -> bool:
    """Whether ``y`` is computed from ``t`` (``t`` among its ancestors, however far back: Mamba's chunked
    scan adds two long paths from one projection)."""
    seen, todo = set(), [y]
    while todo:
        x = todo.pop()
        if x is t:
            return True
        if id(x) in seen or x.producer is None:
            continue
        seen.add(id(x))
        todo += [i for i in x.producer.inputs if isinstance(i, IRTensor)]
    return False


def _narrowing(op: IROp) -> bool:
    """Whether the projection's weight has fewer outputs than inputs (a down projection)."""
    w = next(x for x in op.inputs if isinstance(x, IRTensor) and x.kind == PARAM and len(x.shape) >= 2)
    return w.shape[0] < math.prod(w.shape[1:])


def _reduced_whole(t: IRTensor, dim: int) -> str | None:
    """Whether dim ``dim`` of ``t``, split, reaches an operator with no weight matrix that reads it
    whole (frozen there) or reduces it (the identifier it carries there is missing from its outputs)
    before any weight matrix reads it."""
    todo, seen, reduced, partner, onward = [(t, dim)], set(), None, False, False
    while todo and len(seen) < DEPTH:
        x, d = todo.pop()
        if (id(x), d) in seen:
            continue
        seen.add((id(x), d))
        for r in x.consumers:
            if not r.known or r.overload in LOSS or _weight_matrix(r):
                partner = True  # a partner (or the vocabulary-parallel loss, or cannot tell): the split pays off there
                continue
            for xin, dims in zip(r.inputs, r.bound.inputs):
                if xin is not x or dims is None or d >= len(dims):
                    continue
                i = split_factor(dims[d], 1, r.bound)
                if r.overload in ADDS and any(isinstance(y, IRTensor) and y is not x and y.kind not in STORED
                                              and y.shape == x.shape and not _made_from(y, t) and _streams(y)
                                              for y in r.inputs) and _goes_on(r.outputs[0]):
                    return "whole"  # added to a stream it does not make (a residual): the stream would split
                if r.overload in CUTS and r.bound.markers.get(i) == FROZEN:
                    # each part goes on on its own (the dim where it kept it); a part selected out ends here
                    todo += [(o, d) for o in r.outputs if o is not None and len(o.shape) == len(x.shape)]
                    continue
                if r.bound.markers.get(i) == FROZEN:
                    return "whole"  # read whole (a layer norm's, a softmax's last dim)
                outs = [(o, k) for o, od in zip(r.outputs, r.bound.outputs) if o is not None and od
                        for k, ids in enumerate(od) if i in ids]
                if not outs and any(o is not None for o in r.outputs):
                    reduced = "reduced"  # a norm's statistics (the tensor itself may go on to a partner)
                    onward = onward or any(_goes_on(o) for o in r.outputs if o is not None)
                todo += outs
    if reduced and onward and not partner and not todo:
        return "whole"  # reduced away on every path into the model, no partner anywhere (an indexer's heads summed)
    return reduced


def _goes_on(t: IRTensor, limit: int = 4 * DEPTH) -> bool:
    """Whether the sum ``t`` goes on into the model: a weight matrix or an operator reading a dim whole
    (a norm, a softmax) computes from it within ``limit`` operators. A residual stream does; a
    prediction minus its target (``(proj(x) - y) ** 2``, reduced to the loss by sums) does not, and
    there the column split costs one scalar all-reduce, no more than keeping the projection whole."""
    seen, todo = set(), [t]
    while todo and len(seen) < limit:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        for r in x.consumers:
            if not r.known:
                return True  # cannot tell: a stream, as before
            if r.overload in LOSS:
                continue
            if _weight_matrix(r) or FROZEN in r.bound.markers.values():
                return True
            todo += [o for o in r.outputs if o is not None]
    return len(seen) >= limit  # too far down to tell: a stream, as before


def _streams(t: IRTensor, limit: int = 4 * DEPTH) -> bool:
    """Whether ``t`` carries the batch: made from a model input within ``limit`` producers (a residual stream
    does; a buffer's running statistic, ``ema * 0.5`` beside ``batch_mean * 0.5``, is state, not a stream)."""
    seen, todo = set(), [t]
    while todo and len(seen) < limit:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if x.kind == INPUT:
            return True
        if x.producer is not None:
            todo += [i for i in x.producer.inputs if isinstance(i, IRTensor)]
    return len(seen) >= limit  # too far back to tell: a stream, as before
