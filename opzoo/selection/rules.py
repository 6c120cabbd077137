"""Rules for ops that pick, mask or place along dims, any rank and any dim arguments.

* ``max.dim``/``min.dim`` (values and indices), ``argmax``/``argmin``, ``amax``/``amin``: the dims
  they reduce are frozen (a shard's maximum is not the maximum, and no layout holds partial
  maxima), every other dim spatial; ``keepdim`` leaves a ``1``; no dim: all frozen;
* ``tril``/``triu`` (any ``diagonal``): the last two dims frozen, leading (batch) dims spatial;
* ``scatter`` (``.value``, ``.src``): the scattered dim is frozen in every tensor, the other dims of
  ``self``, ``index`` and ``src`` spatial and shared (calls whose index is smaller than ``self``
  along another dim are not annotated);
* ``repeat``: a repeated dim is frozen (a shard repeated is not a piece of the result), every other
  dim spatial; ``repeats`` follows the local lengths;
* ``reshape_as``/``view_as``: as ``view`` with the output's identifiers on ``other`` (only its shape
  is read), run as ``reshape_as``.
"""
from __future__ import annotations

import torch

from nnscaler.ops import Index, OpCall, annotation_rule

from ..rulekit import Names, along, arg, build, frozen_dim, mark, norm_dim, reshape_dims, usable

FAMILY = "indexing"


def _frozen_reduce(call: OpCall, dims, keepdim: bool, outputs: int = 1):
    x = call.tensor(0)
    dims = [dims] if isinstance(dims, int) else dims
    red = set(range(x.ndim)) if dims is None or (not dims and not isinstance(dims, int)) else \
        {norm_dim(d, x.ndim) for d in dims}
    names = Names()
    din = [names.dim(n) for n in x.shape]
    dout = [("1" if d in red else n) for d, n in enumerate(din) if keepdim or d not in red]
    return build(call, FAMILY, {0: [mark(n, "^") if d in red else n for d, n in enumerate(din)]}, [dout] * outputs)


@annotation_rule("aten.max.dim", "aten.min.dim")
def max_dim_rule(call: OpCall):
    """``a n^ b, ?, ? -> a b, a b`` (values, indices)."""
    if not usable(call) or call.tensor(0).ndim == 0:
        return None
    return _frozen_reduce(call, [arg(call, 1, "dim", 0)], bool(arg(call, 2, "keepdim", False)), outputs=2)


@annotation_rule("aten.argmax.default", "aten.argmin.default", "aten.amax.default", "aten.amin.default")
def arg_reduce_rule(call: OpCall):
    """``a n^, ?, ? -> a`` (``dim`` None or ``[]``: every dim frozen)."""
    if not usable(call) or call.tensor(0).ndim == 0:
        return None
    dim = arg(call, 1, "dim", None)
    if isinstance(dim, int):
        dim = [dim]
    return _frozen_reduce(call, dim, bool(arg(call, 2, "keepdim", False)))


@annotation_rule("aten.tril.default", "aten.triu.default")
def triangle_rule(call: OpCall):
    """``a m^ n^, ? -> a m^ n^``."""
    if not usable(call) or call.tensor(0).ndim < 2:
        return None
    x = call.tensor(0)
    names = Names()
    din = [names.dim(n) for n in x.shape]
    din[-2:] = [mark(d, "^") for d in din[-2:]]
    return build(call, FAMILY, {0: din}, [din])


@annotation_rule("aten.scatter.value", "aten.scatter.src")
def scatter_rule(call: OpCall):
    """``a n^, ?, a k^, ? -> a n^`` (``.value``) or ``a n^, ?, a k^, a k^ -> a n^`` (``.src``)."""
    if not usable(call):
        return None
    x, idx = call.tensor(0), call.tensor(2)
    dim = along(x, idx, call.args[1])
    if dim is None:
        return None
    ins_src = call.overload == "aten.scatter.src"
    if ins_src and tuple(call.tensor(3).shape) != tuple(idx.shape):
        return None
    names, sizes = Names(), {}
    din = [names.dim(n) for n in x.shape]
    dix = list(din)
    din[dim] = frozen_dim(names, x.shape[dim], sizes)
    dix[dim] = frozen_dim(names, idx.shape[dim], sizes)
    ins = {0: din, 2: dix}
    if ins_src:
        ins[3] = dix
    return build(call, FAMILY, ins, [din], sizes=sizes, inputs={2: Index(x.shape[dim])})


@annotation_rule("aten.repeat.default")
def repeat_rule(call: OpCall):
    """``a n, ? -> a (3 n)`` for ``repeats`` ``[1, 3]``: a dim repeated ``r`` times is ``r`` blocks of
    itself, so splitting it splits each block (merged-dim blocks: a rank's slice, repeated, is its
    share of every block); new leading dims fixed numbers, the others spatial."""
    if not usable(call):
        return None
    x, reps = call.tensor(0), list(call.args[1])
    out = call.outputs[0].shape
    lead = len(reps) - x.ndim
    if lead < 0:
        return None
    names, sizes = Names(), {}
    din, dout, items = [], [str(n) for n in out[:lead]], [str(r) for r in reps[:lead]]
    for d, n in enumerate(x.shape):
        r = reps[lead + d]
        if r == 1:
            din.append(names.dim(n))
            dout.append(din[-1])
        else:
            din.append(names.dim(n))
            dout.append(f"({r} {din[-1]})")
        items.append(str(r))
    return build(call, FAMILY, {0: din}, [dout], sizes=sizes, args={1: [int(i) for i in items]})


@annotation_rule("aten.reshape_as.default", "aten.view_as.default")
def reshape_as_rule(call: OpCall):
    """``a (b c), a b c -> a b c``: ``other`` carries the output's identifiers."""
    if not usable(call):
        return None
    dims = reshape_dims(Names(), call.tensor(0).shape, call.tensor(1).shape)
    if dims is None:
        return None
    return build(call, FAMILY, {0: dims[0], 1: dims[1]}, [dims[1]], fn=torch.ops.aten.reshape_as.default)
