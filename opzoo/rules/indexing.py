"""Rules for advanced indexing and index bookkeeping (masks, positions, expert routing).

* ``index.Tensor`` (``x[i, j]`` with tensor indices, no ``None`` entries): the indexed dims of ``x``
  are frozen (an index value addresses the whole dim), the index tensors broadcast together and
  are spatial (an output element reads only its own index element), and ``x``'s remaining dims are
  spatial: ``v^ h, k -> k h``;
* ``index_put`` (also the in-place ``index_put_``, run out of place): everything frozen (a write
  anywhere may land anywhere), except ``x[mask] = v`` with a boolean mask over ``x``'s leading dims
  and one value: element-wise (``a b, a b, 1 -> a b``);
* ``diff``: the differenced dim is frozen, the others spatial; ``prepend``/``append`` share them;
* ``repeat_interleave`` by an int: the repeated dim ``n`` becomes ``(n r)`` with ``r`` the fixed
  count: a rank's rows repeated are its own piece of the result.
"""
from __future__ import annotations

import math
from functools import partial

import torch

from nnscaler.ops import Index, OpCall, TensorMeta, annotation_rule

from ._common import Names, arg, broadcast, build, frozen_dim, norm_dim, usable

FAMILY = "indexing"


@annotation_rule("aten.index.Tensor")
def index_rule(call: OpCall):
    """``v^ h, k -> k h`` (several indices broadcast together: ``v^ w^, a 1, 1 b -> a b``)."""
    if not usable(call):
        return None
    x, idx = call.tensor(0), list(call.args[1])
    if not idx or len(idx) > x.ndim or any(not isinstance(i, TensorMeta) or i.dtype == torch.bool
                                           or i.dtype.is_floating_point for i in idx):
        return None
    names, sizes = Names(), {}
    dx = [frozen_dim(names, n, sizes) for n in x.shape[:len(idx)]]
    rest = [names.dim(n) for n in x.shape[len(idx):]]
    b = broadcast(names, [i.shape for i in idx])
    if b is None:
        return None
    per, dout = b
    if tuple(call.outputs[0].shape) != (*torch.broadcast_shapes(*[i.shape for i in idx]), *x.shape[len(idx):]):
        return None
    cons = [Index(d.rstrip("^") if d != "1" else 1, str(i.dtype).removeprefix("torch.")) for d, i in zip(dx, idx)]
    return build(call, FAMILY, {0: dx + rest, 1: per}, [dout + rest], sizes=sizes, inputs={1: cons})


def index_put(x, *rest, n: int):
    """Out-of-place ``index_put``: ``rest`` is the ``n`` index tensors, ``values`` and optionally
    ``accumulate`` (the index list flattened in place, as the compiler passes it)."""
    accumulate = rest[n + 1] if len(rest) > n + 1 else False
    return torch.ops.aten.index_put.default(x, list(rest[:n]), rest[n], accumulate)


@annotation_rule("aten.index_put.default", "aten.index_put_.default")
def index_put_rule(call: OpCall):
    """``v^, k^, k^, ? -> v^``: frozen; the in-place form runs out of place."""
    if not usable(call) or len(call.args) < 3 or not isinstance(call.args[2], TensorMeta):
        return None
    x, idx, values = call.tensor(0), list(call.args[1]), call.tensor(2)
    if any(not isinstance(i, TensorMeta) for i in idx):
        return None
    names, sizes = Names(), {}
    if len(idx) == 1 and idx[0].dtype == torch.bool and tuple(idx[0].shape) == tuple(x.shape[:len(idx[0].shape)]) \
            and math.prod(values.shape) == 1 and len(values.shape) <= 1:
        # x[mask] = v (or += v) with one value: element-wise, each element written only by its own mask bit
        dx = [names.dim(n) for n in x.shape]
        return build(call, FAMILY, {0: dx, 1: [dx[:len(idx[0].shape)]], 2: [str(n) for n in values.shape]}, [dx],
                     fn=partial(index_put, n=1))
    ins = {0: [frozen_dim(names, n, sizes) for n in x.shape],
           1: [[frozen_dim(names, n, sizes) for n in i.shape] for i in idx],
           2: [frozen_dim(names, n, sizes) for n in values.shape]}
    return build(call, FAMILY, ins, [ins[0]], sizes=sizes, fn=partial(index_put, n=len(idx)))


@annotation_rule("aten.diff.default")
def diff_rule(call: OpCall):
    """``a n^, ?, ?, a 1 -> a m^``: differences along a frozen dim."""
    if not usable(call):
        return None
    x = call.tensor(0)
    dim = norm_dim(arg(call, 2, "dim", -1), x.ndim)
    names, sizes = Names(), {}
    base = [names.dim(n) for n in x.shape]
    ins = {}
    for pos in (0, 3, 4):
        t = call.args[pos] if len(call.args) > pos else None
        if isinstance(t, TensorMeta):
            if t.ndim != x.ndim or any(t.shape[d] != x.shape[d] for d in range(x.ndim) if d != dim):
                return None
            ins[pos] = base[:dim] + [frozen_dim(names, t.shape[dim], sizes)] + base[dim + 1:]
    out = base[:dim] + [frozen_dim(names, call.outputs[0].shape[dim], sizes)] + base[dim + 1:]
    return build(call, FAMILY, ins, [out], sizes=sizes, differentiable=x.dtype.is_floating_point)


@annotation_rule("aten.repeat_interleave.self_int")
def repeat_interleave_rule(call: OpCall):
    """``a n, ?, ? -> a (n 2)``: each row repeated ``r`` times in place."""
    if not usable(call):
        return None
    x, repeats = call.tensor(0), call.args[1]
    dim = arg(call, 2, "dim", None)
    if dim is None or not isinstance(repeats, int) or repeats < 1 or arg(call, 3, "output_size", None) is not None:
        return None
    dim = norm_dim(dim, x.ndim)
    names = Names()
    din = [names.dim(n) for n in x.shape]
    dout = list(din)
    if repeats > 1:
        dout[dim] = f"({din[dim]} {repeats})" if din[dim] != "1" else str(repeats)
    return build(call, FAMILY, {0: din}, [dout])


@annotation_rule("aten.topk.default", "aten.sort.default", "aten.sort.stable")
def select_along_rule(call: OpCall):
    """``a n^, ?, ? -> a k^, a k^`` (``topk``, a router's choice of experts) or ``a n^ -> a n^, a n^``
    (``sort``): the dim selected along is frozen, every other dim spatial."""
    if not usable(call):
        return None
    x = call.tensor(0)
    if call.overload == "aten.topk.default":
        raw = arg(call, 2, "dim", -1)
    elif call.overload == "aten.sort.stable":
        raw = call.kwargs.get("dim", -1)
    else:
        raw = arg(call, 1, "dim", -1)
    dim = norm_dim(raw, x.ndim)
    names, sizes = Names(), {}
    din = [names.dim(n) for n in x.shape]
    if x.ndim:
        din[dim] = frozen_dim(names, x.shape[dim], sizes)
    dout = list(din)
    if x.ndim and call.outputs[0].shape[dim] != x.shape[dim]:
        dout[dim] = frozen_dim(names, call.outputs[0].shape[dim], sizes)
    return build(call, FAMILY, {0: din}, [dout, dout], sizes=sizes)
