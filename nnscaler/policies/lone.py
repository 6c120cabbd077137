"""Column splits with no row partner, for ``tp``: a weight matrix whose split output dim is reduced
whole (a norm's statistics, a router's top-k) before any weight matrix contracts it.

Megatron splits a weight matrix by columns only to pair it with a row-parallel one (or attention by
heads) that contracts the split; a projection whose output a norm or a top-k reads whole stays whole
on every rank ("duplicated": DeepSeek's MLA down projections ahead of their norms, a router). Split
by columns, it costs a collective per use where it has no partner: an all-gather of its output for a
norm (Swin's patch merging ahead of the next stage's norm), or, written into the residual stream, the
stream split by hidden to the end (every norm after it all-reducing its statistics, the head gathering
it back: a shared expert's down projection left column-split after a gate and up kept whole). The
cross-entropy loss is not such a reduction: Megatron's vocabulary-parallel loss reads its logits split.
Attention stays Megatron's: :func:`nnscaler.policies.heads.pin_heads` pins the projections by heads
(QK-norm over the whole projection then all-reduces its statistics), whatever this rule says.
"""
from __future__ import annotations

from ..dimops.grammar import FROZEN
from ..dimops.partition import split_factor
from ..ir.graph import PARAM, IRGraph, IROp, IRTensor

DEPTH = 24  # operators followed from a projection's output (views, element-wise math, residual adds)
# projections whose output dims a weight's rows name (experts' kernels tie their experts to the tokens: no columns)
DENSE = ("aten.linear.default", "aten.addmm.default", "aten.mm.default", "aten.matmul.default", "aten.convolution.default",
         "aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default")
LOSS = ("aten.cross_entropy_loss.default", "aten.nll_loss_nd.default", "aten.nll_loss.default")


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
            if i in params and _reduced_whole(op.outputs[0], d):
                out.setdefault(op.name, set()).add(i)
    return out


def _reduced_whole(t: IRTensor, dim: int) -> bool:
    """Whether dim ``dim`` of ``t``, split, reaches an operator with no weight matrix that reads it
    whole (frozen there) or reduces it (the identifier it carries there is missing from its outputs)
    before any weight matrix reads it."""
    todo, seen = [(t, dim)], set()
    while todo and len(seen) < DEPTH:
        x, d = todo.pop()
        if (id(x), d) in seen:
            continue
        seen.add((id(x), d))
        for r in x.consumers:
            if not r.known:
                continue
            if r.overload in LOSS or _weight_matrix(r):
                continue  # a partner (or the vocabulary-parallel loss): the column split pays off there
            for xin, dims in zip(r.inputs, r.bound.inputs):
                if xin is not x or dims is None or d >= len(dims):
                    continue
                i = split_factor(dims[d], 1, r.bound)
                if r.bound.markers.get(i) == FROZEN:
                    return True  # read whole (a layer norm's, a softmax's last dim)
                outs = [(o, k) for o, od in zip(r.outputs, r.bound.outputs) if o is not None and od
                        for k, ids in enumerate(od) if i in ids]
                if not outs and any(o is not None for o in r.outputs):
                    return True  # reduced (a norm's statistics, a top-k's indices) or dropped
                todo += outs
    return False

