"""Rules for ops that cut, pick or join along one dim, any rank and any dim arguments.

* the dim a ``split``/``chunk``/``unbind`` cuts is ``(k n)`` with the count ``k`` fixed and the
  piece ``n`` a hidden factor (unequal pieces are frozen lengths given in ``sizes``); the dim a
  ``slice``/``select``/``cat``/``stack``/``pad`` works on is frozen (input lengths a literal
  argument depends on are given in ``sizes``), every other dim stays spatial; a whole-dim slice
  stays spatial;
* ``roll`` freezes the dims it rolls (a shard would wrap around its own ends);
* a list of tensors (``cat``, ``stack``) is flattened in place: one annotated input per tensor,
  ``fn`` a :class:`opzoo.rulekit.Regroup` rebuilding the list.
"""
from __future__ import annotations

from nnscaler.ops import OpCall, Size, annotation_rule

from ..rulekit import INT_MAX, Names, arg, build, norm_dim, usable

FAMILY = "shape"


def _out(call: OpCall, i: int = 0) -> tuple[int, ...]:
    return call.outputs[i].shape


def _pieces(call: OpCall, dim: int):
    """Input and output dims of an op cutting ``dim`` into the outputs' pieces, plus Size/sizes:
    ``(k n)`` and a shared ``n`` when the pieces are equal, frozen identifiers otherwise."""
    x = call.tensor(0)
    names = Names()
    din = [names.dim(n) for n in x.shape]
    lens = [m.shape[dim] for m in call.outputs]
    known: dict[str, int] = {}
    if len(set(lens)) == 1:
        piece = names.dim(lens[0])
        din[dim] = f"({len(lens)} {piece})"
        pieces = [piece] * len(lens)
    else:
        din[dim] = names.new() + "^"
        known[din[dim][:-1]] = x.shape[dim]
        by_len: dict[int, str] = {}
        for n in lens:
            by_len.setdefault(n, names.new() + "^")
            known[by_len[n][:-1]] = n
        pieces = [by_len[n] for n in lens]
    douts = [din[:dim] + [p] + din[dim + 1:] for p in pieces]
    return din, douts, pieces, known


@annotation_rule("aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default")
def split_rule(call: OpCall):
    """``a (3 n), ?, ? -> a n, a n, a n`` (split size ``Size("n")``); unequal pieces frozen."""
    if not usable(call):
        return None
    x = call.tensor(0)
    raw = call.args[2] if len(call.args) > 2 else call.kwargs.get("dim", 0)
    dim = norm_dim(raw, x.ndim)
    din, douts, pieces, known = _pieces(call, dim)
    strip = [p.rstrip("^") for p in pieces]
    args = {}
    if call.overload == "aten.split.Tensor":
        args[1] = _length(strip[0])
    elif call.overload == "aten.split_with_sizes.default":
        args[1] = [_length(p) for p in strip]
    elif din[dim].startswith("("):  # equal chunks: their count, which gives them for any length
        args[1] = len(pieces)
    return build(call, FAMILY, {0: din}, douts, args=args, sizes=known)


def _length(expr: str):
    """A piece length as an argument: ``1``, or the Size of its identifier."""
    return 1 if expr == "1" else Size(expr)


@annotation_rule("aten.unbind.int")
def unbind_rule(call: OpCall):
    """``a 3 b, ? -> a b, a b, a b``: the unbound dim has a fixed length, the count of outputs."""
    if not usable(call):
        return None
    x = call.tensor(0)
    dim = norm_dim(call.args[1] if len(call.args) > 1 else 0, x.ndim)
    names = Names()
    din = [names.dim(n) for n in x.shape]
    din[dim] = str(x.shape[dim])
    dout = din[:dim] + din[dim + 1:]
    return build(call, FAMILY, {0: din}, [dout] * x.shape[dim])


@annotation_rule("aten.slice.Tensor")
def slice_rule(call: OpCall):
    """``a n^, ?, ?, ?, ? -> a m^`` with ``n`` given in ``sizes``; a whole-dim slice (start 0, step
    1, end past the end) keeps the dim spatial, its end ``Size("n")`` unless it was INT_MAX; an
    empty slice is ``a 0``."""
    if not usable(call, empty_ok=0 not in call.tensor(0).shape):
        return None
    x = call.tensor(0)
    dim = norm_dim(arg(call, 1, "dim", 0), x.ndim)
    start, end, step = arg(call, 2, "start", None), arg(call, 3, "end", None), arg(call, 4, "step", 1)
    names = Names()
    din = [names.dim(n) for n in x.shape]
    n = x.shape[dim]
    if x.ndim == 0 or n == 1:
        return build(call, FAMILY, {0: din}, [din])
    if start in (0, None) and step == 1 and (end is None or end >= n):
        args, kwargs = {}, dict(call.kwargs)
        if end is not None and end != INT_MAX:  # an end at the dim's length follows the local length
            if len(call.args) > 3:
                args[3] = Size(din[dim])
            else:
                kwargs["end"] = Size(din[dim])
        return build(call, FAMILY, {0: din}, [din], args=args, kwargs=kwargs)
    strided = _strided(call, n, start, end, step, names)
    if strided:
        din[dim], out = strided
        args, kwargs = {}, dict(call.kwargs)
        if end is not None and end != INT_MAX:  # an end at or past the dim's length: to the local end
            if len(call.args) > 3:
                args[3] = INT_MAX
            else:
                kwargs["end"] = INT_MAX
        return build(call, FAMILY, {0: din}, [din[:dim] + [out] + din[dim + 1:]], args=args, kwargs=kwargs)
    frozen, out = names.new() + "^", names.dim(_out(call)[dim])
    dout = din[:dim] + [out if out in ("0", "1") else out + "^"] + din[dim + 1:]
    din[dim] = frozen
    return build(call, FAMILY, {0: din}, [dout], sizes={frozen[:-1]: n})


def _strided(call: OpCall, n: int, start, end, step, names: Names) -> tuple[str, str] | None:
    """A strided slice over the whole dim (``x[..., 1::2]``: ``0 <= start < step``, to the end, ``step``
    dividing ``n``) picks one phase of each group of ``step``: ``(m step) -> m``, ``m`` spatial, each
    shard the same slice of its own block (an interleaved gate|up projection cut by columns)."""
    start = 0 if start is None else start + n if start < 0 else start
    if not (isinstance(step, int) and step > 1 and n % step == 0 and 0 <= start < step
            and (end is None or end >= n) and n // step > 1):
        return None
    m = names.dim(n // step)
    return f"({m} {step})", m


@annotation_rule("aten.select.int")
def select_rule(call: OpCall):
    """``a n^ b, ?, ? -> a b`` with ``n`` given in ``sizes`` (the index is a fixed position)."""
    if not usable(call):
        return None
    x = call.tensor(0)
    dim = norm_dim(call.args[1], x.ndim)
    names = Names()
    din = [names.dim(n) for n in x.shape]
    known = {}
    if din[dim] != "1":
        known[din[dim]] = x.shape[dim]
        din[dim] += "^"
    return build(call, FAMILY, {0: din}, [din[:dim] + din[dim + 1:]], sizes=known)


@annotation_rule("aten.cat.default", "aten.concatenate.default", "aten.concat.default", "aten.stack.default")
def cat_rule(call: OpCall):
    """``a n^, a m^, ? -> a o^`` (``cat``, ``concatenate``, ``concat``) or ``a b, a b, ? -> a 2 b`` (``stack``):
    the list of tensors is flattened in place into separate inputs (see :class:`opzoo.rulekit.Regroup`);
    an empty piece is ``a 0``. A 1-d empty piece beside higher-rank ones (the start of a key/value
    cache, ``cat([torch.tensor([]), k], -2)``, which ``cat`` skips) is ``0`` and passed on as is."""
    if not call.args[0] or not usable(call, empty_ok=0 not in call.outputs[0].shape):
        return None
    xs = list(call.args[0])
    out = _out(call)
    raw = call.args[1] if len(call.args) > 1 else call.kwargs.get("dim", 0)
    stack = call.overload == "aten.stack.default"
    skipped = [not stack and len(out) != 1 and tuple(m.shape) == (0,) for m in xs]  # cat's legacy rule
    if all(skipped) or any(m.ndim != len(out) - stack for m, s in zip(xs, skipped) if not s):
        return None  # a bad call
    dim = norm_dim(raw, len(out))
    names = Names()
    base = [names.dim(n) for n in out]
    if stack:
        base[dim] = str(len(xs))
        ins = [base[:dim] + base[dim + 1:] for _ in xs]
        if any(tuple(m.shape) != tuple(xs[0].shape) for m in xs):
            return None
        return build(call, FAMILY, {0: ins}, [base])
    ins = []
    for m, skip in zip(xs, skipped):
        if skip:
            ins.append(["0"])
            continue
        dims = list(base)
        dims[dim] = names.dim(m.shape[dim])
        if m.shape[:dim] + m.shape[dim + 1:] != out[:dim] + out[dim + 1:]:
            return None  # empty only along another dim
        if dims[dim] not in ("0", "1"):
            dims[dim] += "^"
        ins.append(dims)
    if base[dim] != "1":
        base[dim] += "^"
    return build(call, FAMILY, {0: ins}, [base])


@annotation_rule("aten.pad.default", "aten.constant_pad_nd.default")
def pad_rule(call: OpCall):
    """``a n^, ?, ?, ? -> a m^``: padded dims frozen (their input lengths in ``sizes``), others
    spatial (any mode: a pad only reads along its own dim)."""
    if not usable(call):
        return None
    x, pads = call.tensor(0), list(call.args[1])
    names = Names()
    din = [names.dim(n) for n in x.shape]
    dout, known = list(din), {}
    for k in range(len(pads) // 2):
        d = x.ndim - 1 - k
        if d < 0:
            return None
        if pads[2 * k] or pads[2 * k + 1]:
            if din[d] != "1":
                known[din[d]] = x.shape[d]
                din[d] += "^"
            n = _out(call)[d]
            dout[d] = names.dim(n) + ("^" if n != 1 else "")
    return build(call, FAMILY, {0: din}, [dout], sizes=known)


@annotation_rule("aten.roll.default")
def roll_rule(call: OpCall):
    """``a h^ w^ c, ?, ? -> a h^ w^ c``: the rolled dims are frozen (a shard would wrap around its own
    ends), every other dim spatial; a roll with no dims (of the flattened tensor) freezes them all."""
    if not usable(call):
        return None
    x = call.tensor(0)
    dims = arg(call, 2, "dims", [])
    dims = [dims] if isinstance(dims, int) else list(dims)
    rolled = {norm_dim(d, x.ndim) for d in dims} if dims else set(range(x.ndim))
    names = Names()
    din = [names.dim(n) + ("^" if d in rolled and n != 1 else "") for d, n in enumerate(x.shape)]
    return build(call, FAMILY, {0: din}, [din])
