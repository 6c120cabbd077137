"""Rules for reshapes, permutations and ``expand``, any rank and any dim arguments
(:mod:`opzoo.slicing.rules` has the ops that cut, pick or join along a dim).

* reshapes (``view``, ``reshape``, ``flatten``, ``unflatten``, ``squeeze``, ``unsqueeze``) keep
  row-major order: dims with equal products are refined into common factors (``a (b c) -> a b c``),
  only a group's first factor may be split, and shape arguments are ``Size`` expressions (a ``-1``
  stays ``-1``) so a rank reshapes its shard to its local lengths;
* ``transpose``/``permute``/``t`` move identifiers; ``expand`` names new lengths (given in
  ``sizes``) and keeps ``-1``; ``squeeze`` runs as :class:`SqueezeDims` of the dims that had
  length 1 in the call (a split dim whose local length is 1 must stay);
* ``as_strided`` of a contiguous tensor (the only kind the trace lets through: ``nnscaler/trace/strided.py``)
  carries each input dim its read steps through exactly once (:func:`as_strided_rule`: Longformer's
  overlapping chunks keep their batch x heads, their width and their head dim), its size and stride
  arguments ``Size`` expressions of the local lengths.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from nnscaler.ops import OpCall, annotation_rule

from ..rulekit import Names, arg, build, frozen_dim, norm_dim, reshape_dims, size_arg, usable

FAMILY = "shape"


def _out(call: OpCall, i: int = 0) -> tuple[int, ...]:
    return call.outputs[i].shape


def _reshape(call: OpCall, shape_pos: int | None = None, orig: list | None = None, offset: int = 0):
    """Annotate a reshape of argument 0 into output 0; the argument at ``shape_pos`` becomes the
    Size of output dims ``offset ..`` (``orig`` its original values, whose ``-1`` stay)."""
    if not usable(call):
        return None
    dims = reshape_dims(Names(), call.tensor(0).shape, _out(call))
    if dims is None:
        return None
    din, dout = dims
    args = {}
    if shape_pos is not None:
        vals = list(orig)
        args[shape_pos] = size_arg(["-1" if v == -1 else dout[offset + k] for k, v in enumerate(vals)])
    return build(call, FAMILY, {0: din}, [dout], args=args)


@annotation_rule("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default")
def view_rule(call: OpCall):
    """``a b c, ? -> a (b c)`` with ``Size("a (b c)")`` (or ``-1`` where the call had one). Run as
    ``reshape``: a layout conversion may hand a rank a non-contiguous shard of a tensor that was
    contiguous whole (export drops a ``contiguous()`` it saw as a no-op), where ``view`` fails."""
    shape = call.args[1]
    spec = _reshape(call, 1, [shape] if isinstance(shape, int) else list(shape))
    return spec and replace(spec, fn=torch.ops.aten.reshape.default)


@annotation_rule("aten.flatten.using_ints", "aten.unsqueeze.default")
def flatten_rule(call: OpCall):
    """Reshapes whose extra arguments are dim positions (kept as written)."""
    return _reshape(call)


@dataclass(frozen=True)
class SqueezeDims:
    """``squeeze`` of exactly the dims that had length 1 in the traced call (its dim arguments are
    ignored): a split dim whose local length happens to be 1 must not be squeezed away."""

    dims: tuple[int, ...]

    def __call__(self, x, *ignored):
        return torch.ops.aten.squeeze.dims(x, list(self.dims))


@annotation_rule("aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default")
def squeeze_rule(call: OpCall):
    """``a 1 b, ? -> a b``, run as :class:`SqueezeDims` of the call's length-1 dims."""
    x = call.tensor(0)
    if call.overload == "aten.squeeze.default":
        dims = range(x.ndim)
    else:
        dims = call.args[1] if len(call.args) > 1 else call.kwargs["dim"]
        dims = [norm_dim(d, x.ndim) for d in ([dims] if isinstance(dims, int) else dims)]
    ones = tuple(sorted({d for d in dims if x.ndim and x.shape[d] == 1}))
    spec = _reshape(call)
    return spec and replace(spec, fn=SqueezeDims(ones))


@annotation_rule("aten.unflatten.int")
def unflatten_rule(call: OpCall):
    """``a (b c), ?, ? -> a b c`` with the sizes as ``Size("b c")``."""
    x, dim, sizes = call.tensor(0), call.args[1], list(call.args[2])
    return _reshape(call, 2, sizes, norm_dim(dim, x.ndim))


@annotation_rule("aten.transpose.int", "aten.permute.default", "aten.t.default")
def permute_rule(call: OpCall):
    """``a b c, ? -> c a b``: the output names the input's identifiers in the new order."""
    if not usable(call):
        return None
    x = call.tensor(0)
    names = Names()
    din = [names.dim(n) for n in x.shape]
    order = list(range(x.ndim))
    if call.overload == "aten.transpose.int" and x.ndim:
        d0, d1 = norm_dim(call.args[1], x.ndim), norm_dim(call.args[2], x.ndim)
        order[d0], order[d1] = order[d1], order[d0]
    elif call.overload == "aten.permute.default":
        order = [norm_dim(d, x.ndim) for d in call.args[1]]
    elif call.overload == "aten.t.default":
        order = order[::-1]
    return build(call, FAMILY, {0: din}, [[din[d] for d in order]])


@annotation_rule("aten.expand.default")
def expand_rule(call: OpCall):
    """``1 a, ? -> b a`` with ``Size("b -1")``: new and stretched dims are output identifiers whose
    lengths go in ``sizes``; a ``-1`` keeps the input's dim."""
    if not usable(call):
        return None
    x, sizes, out = call.tensor(0), list(call.args[1]), _out(call)
    names = Names()
    din = [names.dim(n) for n in x.shape]
    lead = len(out) - x.ndim
    dout, known = [], {}
    for k, n in enumerate(out):
        if k >= lead and x.shape[k - lead] == n:
            dout.append(din[k - lead])
        else:
            dout.append(names.dim(n))
            if n != 1:
                known[dout[-1]] = n
    items = ["-1" if v == -1 else d for v, d in zip(sizes, dout)]
    return build(call, FAMILY, {0: din}, [dout], args={1: size_arg(items)}, sizes=known)



@annotation_rule("aten.view_as_complex.default")
def view_as_complex_rule(call: OpCall):
    """``a b 2 -> a b``: pairs of reals as one complex number (complex rotary embeddings), every
    other dim spatial."""
    if not usable(call):
        return None
    x = call.tensor(0)
    if x.ndim < 1 or x.shape[-1] != 2:
        return None
    names = Names()
    lead = [names.dim(n) for n in x.shape[:-1]]
    return build(call, FAMILY, {0: lead + ["2"]}, [lead])


@annotation_rule("aten.view_as_real.default")
def view_as_real_rule(call: OpCall):
    """``a b -> a b 2``: each complex number as its (real, imaginary) pair (the way back of
    :func:`view_as_complex_rule`), every dim spatial."""
    if not usable(call):
        return None
    names = Names()
    dims = [names.dim(n) for n in call.tensor(0).shape]
    return build(call, FAMILY, {0: dims}, [dims + ["2"]])


def strided_read(x, size, stride):
    """``as_strided`` of ``x`` read as a contiguous tensor (from its first element): what the traced call did
    on one device, whatever layout a rank holds ``x`` in."""
    return x.contiguous().as_strided(size, stride)


def _carried(shape: tuple[int, ...], size: list[int], stride: list[int]) -> dict[int, int]:
    """Output dim -> the input dim of a contiguous ``shape`` it reads through exactly: equal length and
    stride, no other output dim stepping that input dim (a stride that is a whole multiple of the dims
    inside it counts where it moves the outermost input dim it can), and the steps of the output dims
    inside it never carrying into it. Each such input dim is a batch of independent reads."""
    n = len(shape)
    inner = [1] * n  # contiguous strides
    for d in range(n - 2, -1, -1):
        inner[d] = inner[d + 1] * shape[d + 1]
    moves = [next(k for k in range(n) if s % inner[k] == 0) if s else None for s in stride]
    out = {}
    for i, (m, s) in enumerate(zip(size, stride)):
        j = moves[i]
        if m == 1 or j is None or shape[j] != m or inner[j] != s:
            continue
        others = [o for o in range(len(size)) if o != i and size[o] > 1 and moves[o] is not None]
        if any(moves[o] == j for o in others):
            continue
        if sum((size[o] - 1) * stride[o] for o in others if moves[o] > j) >= inner[j]:
            continue
        out[i] = j
    return out


@annotation_rule("aten.as_strided.default")
def as_strided_rule(call: OpCall):
    """``c^ a d, ?, ? -> a e^ d`` with ``Size`` lengths and strides: an output dim that reads one input dim
    of a contiguous tensor through exactly (:func:`_carried`) shares its identifier (split spatially: each
    rank reads its block of that dim, the steps of the other dims written over the local lengths); every
    other dim is frozen. ``None`` with an explicit ``storage_offset`` (an absolute position in a storage a
    rank does not hold) or where no dim is carried. Run as :func:`strided_read`."""
    if not usable(call) or arg(call, 3, "storage_offset") is not None:
        return None
    x, size, stride = call.tensor(0), list(call.args[1]), list(call.args[2])
    if x.ndim == 0 or len(size) != len(stride) or any(s < 0 for s in stride):
        return None
    carried = _carried(x.shape, size, stride)
    if not carried:
        return None
    names, known = Names(), {}
    by_input = {j: i for i, j in carried.items()}
    din = [names.dim(n) if k in by_input else frozen_dim(names, n, known) for k, n in enumerate(x.shape)]
    dout = [din[carried[i]] if i in carried else frozen_dim(names, m, known) for i, m in enumerate(size)]
    plain = [d.rstrip("^") for d in din]
    steps = []
    for s in stride:
        k = next((k for k in range(x.ndim) if s and s % math.prod(x.shape[k + 1:]) == 0), None)
        if k is None:
            steps.append(str(s))
            continue
        factors = [str(s // math.prod(x.shape[k + 1:]))] + [p for p in plain[k + 1:] if p != "1"]
        steps.append("(" + " ".join(factors) + ")")
    lengths = [d.rstrip("^") for d in dout]
    return build(call, FAMILY, {0: din}, [dout], args={1: size_arg(lengths), 2: size_arg(steps)},
                 sizes=known, fn=strided_read)
