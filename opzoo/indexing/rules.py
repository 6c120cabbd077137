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

from .. import kernels as K
from ..rulekit import Names, along, arg, broadcast, build, frozen_dim, norm_dim, usable

FAMILY = "indexing"


@annotation_rule("aten.index.Tensor")
def index_rule(call: OpCall):
    """``v^ h, k -> k h`` (several indices broadcast together: ``v^ w^, a 1, 1 b -> a b``); leading
    ``None`` entries (``x[:, :, i]``) keep their dims spatial in front: ``a v^ h, k -> a k h``."""
    if not usable(call):
        return None
    x, entries = call.tensor(0), list(call.args[1])
    lead = next((p for p, i in enumerate(entries) if i is not None), len(entries))
    idx = entries[lead:]
    if not idx or lead + len(idx) > x.ndim or any(not isinstance(i, TensorMeta) or i.dtype == torch.bool
                                                  or i.dtype.is_floating_point for i in idx):
        return None
    names, sizes = Names(), {}
    front = [names.dim(n) for n in x.shape[:lead]]
    dx = [frozen_dim(names, n, sizes) for n in x.shape[lead:lead + len(idx)]]
    rest = [names.dim(n) for n in x.shape[lead + len(idx):]]
    b = broadcast(names, [i.shape for i in idx])
    if b is None:
        return None
    per, dout = b
    if tuple(call.outputs[0].shape) != (*x.shape[:lead], *torch.broadcast_shapes(*[i.shape for i in idx]),
                                        *x.shape[lead + len(idx):]):
        return None
    cons = [Index(d.rstrip("^") if d != "1" else 1, str(i.dtype).removeprefix("torch.")) for d, i in zip(dx, idx)]
    fn = None if not lead else partial(index_after, lead=lead)
    return build(call, FAMILY, {0: front + dx + rest, 1: per}, [front + dout + rest], sizes=sizes,
                 inputs={1: cons}, fn=fn)


def index_after(x, *idx, lead: int):
    """``x[(slice(None),) * lead + idx]``: the index tensors (flattened in place, as the compiler
    passes them) after ``lead`` whole dims."""
    return torch.ops.aten.index.Tensor(x, [None] * lead + list(idx))


@annotation_rule("aten.gather.default")
def gather_rule(call: OpCall):
    """``a b n+, ?, a b k -> a b k``: the dims the index shares with the input (same lengths)
    spatial, the gathered dim ``n`` split by value by the masked local lookup of
    :func:`opzoo.kernels.gather` (an index outside a rank's range gives zero there; the
    ranks' partial values sum to the result); relative-position biases gather this way."""
    if not usable(call) or len(call.args) != 3 or call.kwargs.get("sparse_grad"):
        return None
    x, index = call.tensor(0), call.tensor(2)
    d = along(x, index, call.args[1])
    if d is None:
        return None
    names = Names()
    n = names.dim(x.shape[d], "n")
    shared = [names.dim(m) for m in x.shape]
    k = names.dim(index.shape[d], "k")
    dx, di = list(shared), list(shared)
    dx[d], di[d] = (n + "+" if n != "1" else n), k
    local = partial(K.gather, ident=n) if n != "1" else None
    return build(call, FAMILY, {0: dx, 2: di}, [di], kwargs={}, local=local,
                 inputs={2: Index(n if n != "1" else 1, str(index.dtype).removeprefix("torch."))})


@annotation_rule("aten.index_select.default")
def index_select_rule(call: OpCall):
    """``a v+ b, ?, k -> a k b``: the selected dim split by value (the masked local lookup of
    :func:`opzoo.kernels.index_select`), the others spatial."""
    if not usable(call) or len(call.args) != 3:
        return None
    x, index = call.tensor(0), call.tensor(2)
    if x.ndim == 0 or index.ndim != 1:
        return None
    d = norm_dim(call.args[1], x.ndim)
    names = Names()
    v = names.dim(x.shape[d], "v")
    dx = [names.dim(m) for m in x.shape]
    k = names.dim(index.shape[0], "k")
    dout = list(dx)
    dx[d], dout[d] = (v + "+" if v != "1" else v), k
    local = partial(K.index_select, ident=v) if v != "1" else None
    return build(call, FAMILY, {0: dx, 2: [k]}, [dout], local=local,
                 inputs={2: Index(v if v != "1" else 1, str(index.dtype).removeprefix("torch."))})


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
    m = len(idx[0].shape) if idx else 0
    if len(idx) == 1 and idx[0].dtype == torch.bool and tuple(idx[0].shape) == tuple(x.shape[:m]) and (
            math.prod(values.shape) == 1 and len(values.shape) <= 1 or tuple(values.shape) == tuple(x.shape[m:])):
        # x[mask] = v (or += v) with one value, or one row v of x's trailing dims (T5Gemma's end-of-image
        # embedding): element-wise, each element written only by its own mask bit (and v's element)
        dx = [names.dim(n) for n in x.shape]
        dv = [str(n) for n in values.shape] if math.prod(values.shape) == 1 and len(values.shape) <= 1 else dx[m:]
        return build(call, FAMILY, {0: dx, 1: [dx[:m]], 2: dv}, [dx], fn=partial(index_put, n=1))
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
