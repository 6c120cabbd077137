"""Rules for reductions and normalisers over any dims, as :mod:`opzoo.reduction.entries` splits them.

* ``sum`` over any dims (``keepdim`` or not, all dims when none are given): the reduced dims are
  split by value (``+``), the plain op on a shard gives partial sums;
* ``mean``: the same split with the partition-aware kernel :func:`opzoo.kernels.mean`
  (local sum over the FULL count of the reduced identifiers);
* ``softmax``/``log_softmax`` and ``cumsum``: the dim they run along is frozen (``^``), every
  other dim spatial;
* ``var``/``std``: the reduced dims are frozen (not a sum of per-shard parts), the others spatial;
* ``max``/``min``/``any``/``all`` over every element of an integer or boolean tensor (no gradient:
  XLM's ``lengths.max()``, FSMT's ``padding_mask.any()``, read by a data-dependent guard): every dim
  splits, and :func:`opzoo.kernels.whole_extreme` reduces the rank's shard, then all ranks' results
  in one all-reduce (MAX; MIN as the MAX of the negation) per split identifier, which the spec names
  ``coupled`` (counted apart in plan reports, as batch norm's statistics are). A floating tensor's
  ``max()``/``min()`` has every dim frozen (read whole, the plain op: its gradient goes to the
  maximal elements, as on one device), so that no integer example entry ever answers for it.
"""
from __future__ import annotations

from functools import partial

import torch

from nnscaler.ops import Index, Mask, OpCall, annotation_rule

from .. import kernels as K
from ..rulekit import Names, build, mark, norm_dim, usable

FAMILY = "reduction"


def _reduce(call: OpCall, dims, keepdim: bool):
    """Input and output dims of reducing ``dims`` (``None`` or empty: all) with ``+``, and the
    reduced identifiers."""
    x = call.tensor(0)
    if isinstance(dims, int):
        dims = [dims]
    red = set(range(x.ndim)) if not dims else {norm_dim(d, x.ndim) for d in dims}
    names = Names()
    din = [names.dim(n) for n in x.shape]
    idents = tuple(din[d] for d in sorted(red) if din[d] != "1")
    dout = []
    for d, name in enumerate(din):
        if d not in red:
            dout.append(name)
        elif keepdim:
            dout.append("1")
    return [mark(n, "+") if d in red else n for d, n in enumerate(din)], dout, idents


def _reduction(call: OpCall, mean: bool):
    if not usable(call):
        return None
    args = list(call.args) + [None] * (3 - len(call.args))
    dims = call.kwargs.get("dim", args[1])
    keepdim = bool(call.kwargs.get("keepdim", args[2] or False))
    if call.overload.endswith(".default"):
        dims, keepdim = None, False
    din, dout, idents = _reduce(call, dims, keepdim)
    local = partial(K.mean, idents=idents) if mean else None
    return build(call, FAMILY, {0: din}, [dout], local=local)


@annotation_rule("aten.sum.dim_IntList", "aten.sum.default")
def sum_rule(call: OpCall):
    """``a+ b c+, ?, ? -> b`` (``keepdim``: ``-> 1 b 1``): partial sums over the reduced dims."""
    return _reduction(call, mean=False)


@annotation_rule("aten.mean.dim", "aten.mean.default")
def mean_rule(call: OpCall):
    """As ``sum``, run by the kernel dividing the local sum by the full count."""
    if not call.tensor(0).dtype.is_floating_point:
        return None
    return _reduction(call, mean=True)


@annotation_rule("aten.softmax.int", "aten.log_softmax.int", "aten._softmax.default",
                 "aten._log_softmax.default", "aten.cumsum.default", "aten.cumprod.default",
                 "aten.logcumsumexp.default")
def along_dim_rule(call: OpCall):
    """``a b n^, ?, ? -> a b n^``: the dim the op runs along is frozen."""
    if not usable(call):
        return None
    x = call.tensor(0)
    names = Names()
    din = [names.dim(n) for n in x.shape]
    if x.ndim:
        d = norm_dim(call.args[1] if len(call.args) > 1 else call.kwargs["dim"], x.ndim)
        din[d] = mark(din[d], "^")
    return build(call, FAMILY, {0: din}, [din])


@annotation_rule("aten.var.dim", "aten.var.correction", "aten.std.dim", "aten.std.correction")
def spread_rule(call: OpCall):
    """``a b n^, ?, ? .. -> a b 1`` (``keepdim``) or ``-> a b``: a variance or standard deviation
    is not a sum of per-shard parts, so the reduced dims are frozen; every other dim is spatial."""
    if not usable(call) or not call.tensor(0).dtype.is_floating_point:
        return None
    x = call.tensor(0)
    dims = call.args[1] if len(call.args) > 1 else call.kwargs.get("dim")
    keepdim = call.args[3] if call.overload.endswith(".dim") and len(call.args) > 3 else call.kwargs.get("keepdim", False)
    dims = [dims] if isinstance(dims, int) else dims
    red = set(range(x.ndim)) if not dims else {norm_dim(d, x.ndim) for d in dims}
    names = Names()
    din = [names.dim(n) for n in x.shape]
    dout = [("1" if d in red else n) for d, n in enumerate(din) if keepdim or d not in red]
    return build(call, FAMILY, {0: [mark(n, "^") if d in red else n for d, n in enumerate(din)]}, [dout])


RARE = 0.15  # the share of the value that decides a boolean tensor's any (true) or all (false), in samples
_EXTREME = {"aten.max.default": "max", "aten.min.default": "min", "aten.any.default": "max", "aten.all.default": "min"}


@annotation_rule(*_EXTREME)
def whole_extreme_rule(call: OpCall):
    """``a b -> 1`` on an integer or boolean tensor: the extreme of each shard, then of the shards'
    (one all-reduce per split identifier, ``coupled``); ``a^ b^ -> 1`` on a floating one."""
    x = call.tensor(0)
    if not usable(call) or x.ndim == 0 or x.dtype.is_complex:
        return None
    names = Names()
    din = [names.dim(n) for n in x.shape]
    if x.dtype.is_floating_point:
        return build(call, FAMILY, {0: [d if d == "1" else mark(d, "^") for d in din]}, [[]])
    idents = tuple(d for d in din if d != "1")
    op = _EXTREME[call.overload]
    local = partial(K.whole_extreme, op=op, idents=idents)
    # sample values whose extreme a shard often lacks (a check that can fail): few trues (any), few falses (all)
    values = (Mask(RARE if op == "max" else 1 - RARE) if x.dtype == torch.bool
              else Index(1000, str(x.dtype).removeprefix("torch.")))
    return build(call, FAMILY, {0: din}, [[]], local=local, coupled=idents, differentiable=False,
                 inputs={0: values})
