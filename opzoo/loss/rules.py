"""Rules for ``cross_entropy_loss`` and ``nll_loss_nd`` in aten's positional form ``(input, target,
weight, reduction, ignore_index[, label_smoothing])``, reduction as aten's enum (0 none, 1 mean,
2 sum). Classes are split by value with the vocabulary-parallel kernels of
:mod:`opzoo.kernels`; rows are spatial for ``none`` and split by value when reduced
(``mean`` divides by the full count of non-ignored targets). Only 2-d ``(rows, classes)`` input
with class-index targets, no class weights and no label smoothing is annotated.
"""
from __future__ import annotations

import math
from functools import partial

import torch

from nnscaler.ops import Index, OpCall, annotation_rule

from .. import kernels as K
from ..rulekit import Names, build, mark, usable

FAMILY = "loss"
REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
DEFAULTS = (("weight", None), ("reduction", 1), ("ignore_index", -100), ("label_smoothing", 0.0))


def loss_local(shard, logits, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0, *,
               kernel, row, cls):
    """aten's positional loss call -> the kernel, with the reduction enum as its name."""
    return kernel(shard, logits, target, REDUCTIONS[reduction], ignore_index, row=row, cls=cls)


@annotation_rule("aten.cross_entropy_loss.default", "aten.nll_loss_nd.default", "aten.nll_loss.default")
def class_loss_rule(call: OpCall):
    """``n v+, n, ?, ?, ? -> n`` (``none``) or ``n+ v+, n+, ?, ?, ? -> 1`` (``mean``, ``sum``)."""
    if not usable(call):
        return None
    x, target = call.tensor(0), call.tensor(1)
    opts = {name: call.args[2 + i] if len(call.args) > 2 + i else call.kwargs.get(name, default)
            for i, (name, default) in enumerate(DEFAULTS)}
    if (x.ndim != 2 or target.shape != x.shape[:1] or target.dtype.is_floating_point
            or opts["weight"] is not None or opts["label_smoothing"] or opts["reduction"] not in REDUCTIONS):
        return None
    names = Names()
    n, v = names.dim(x.shape[0], "n"), names.dim(x.shape[1], "v")
    reduced = opts["reduction"] != 0
    row = mark(n, "+") if reduced else n
    kernel = K.cross_entropy if call.overload.startswith("aten.cross_entropy") else K.nll_loss
    local = partial(loss_local, kernel=kernel, row=n, cls=v)
    dtype = str(target.dtype).removeprefix("torch.")
    return build(call, FAMILY, {0: [row, mark(v, "+")], 1: [row]}, [["1"] if reduced else [n]], local=local,
                 inputs={1: Index(x.shape[1] if v == "1" else v, dtype)},
                 unordered=(n,) if reduced else ())  # a sum and a count over the rows: any order


def scaled_squared_error(x, y, reduction=None, *, scale):
    """``sum((x - y)**2) * scale``: ``mse_loss`` with ``scale`` 1/count (mean) or 1 (sum). On shards
    the local sums are partial values of the whole (the count is the whole tensor's)."""
    return torch.sum((x - y) ** 2) * scale


@annotation_rule("aten.mse_loss.default")
def mse_loss_rule(call: OpCall):
    """``a b, a b, ? -> a b`` (``none``) or ``a+ b+, a+ b+, ? -> 1`` (``mean``, ``sum``, as
    :func:`scaled_squared_error` with the whole count fixed)."""
    if not usable(call):
        return None
    x, y = call.tensor(0), call.tensor(1)
    reduction = call.args[2] if len(call.args) > 2 else call.kwargs.get("reduction", 1)
    if x.shape != y.shape or reduction not in REDUCTIONS:
        return None
    names = Names()
    dims = [names.dim(n) for n in x.shape]
    if reduction == 0:
        return build(call, FAMILY, {0: dims, 1: dims}, [dims])
    scale = 1.0 / max(1, math.prod(x.shape)) if reduction == 1 else 1.0
    split = [mark(d, "+") for d in dims]
    return build(call, FAMILY, {0: split, 1: split}, [[]], kwargs={}, fn=partial(scaled_squared_error, scale=scale))
