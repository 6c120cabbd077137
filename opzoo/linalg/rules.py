"""Rules for ``linear`` and ``matmul`` at any batch rank, as :mod:`opzoo.linalg.entries` splits them: the
contracted dim is split by value (``k+``, results are partial sums; a bias, written ``+n``, is then
held by one rank), every other dim is spatial; ``matmul``'s batch dims broadcast like an
element-wise op (``1`` where one side broadcasts), and 1-d operands follow ``torch.matmul``.
"""
from __future__ import annotations

from nnscaler.ops import OpCall, TensorMeta, annotation_rule

from ..rulekit import Names, broadcast, build, mark, usable

FAMILY = "linalg"


@annotation_rule("aten.linear.default")
def linear_rule(call: OpCall):
    """``a b k+, n k+, +n -> a b n`` (the bias ``?`` when None; ``+``: a partial value under a ``k`` split)."""
    if not usable(call):
        return None
    x, w = call.tensor(0), call.tensor(1)
    bias = call.args[2] if len(call.args) > 2 else call.kwargs.get("bias")
    if x.ndim < 1 or w.ndim not in (1, 2) or x.shape[-1] != w.shape[-1]:
        return None
    names = Names()
    batch = [names.dim(n) for n in x.shape[:-1]]
    k = mark(names.dim(x.shape[-1], "k"), "+")
    n = [names.dim(w.shape[0], "n")] if w.ndim == 2 else []
    ins = {0: batch + [k], 1: n + [k]}
    if isinstance(bias, TensorMeta):
        if tuple(bias.shape) != tuple(w.shape[:1] if w.ndim == 2 else ()):
            return None
        ins[2] = ["+" + (n or ["1"])[0]]  # added after the contraction: a partial value
    return build(call, FAMILY, ins, [batch + n])


@annotation_rule("aten.matmul.default")
def matmul_rule(call: OpCall):
    """``a 1 m k+, b k+ n -> a b m n`` (batch dims broadcast), ``m k+, k+ -> m``, ``k+, k+ -> 1``."""
    if not usable(call):
        return None
    x, y = call.tensor(0), call.tensor(1)
    if x.ndim == 0 or y.ndim == 0 or x.shape[-1] != y.shape[-2 if y.ndim > 1 else -1]:
        return None
    names = Names()
    k = mark(names.dim(x.shape[-1], "k"), "+")
    m = [names.dim(x.shape[-2], "m")] if x.ndim > 1 else []
    n = [names.dim(y.shape[-1], "n")] if y.ndim > 1 else []
    dims = broadcast(names, [x.shape[:-2], y.shape[:-2]])
    if dims is None:
        return None
    (bx, by), bout = dims
    return build(call, FAMILY, {0: bx + m + [k], 1: by + [k] + n}, [bout + m + n])


def _einsum_terms(equation: str, ndims: list[int]) -> tuple[list[str], str] | None:
    """The operand terms and the output of an einsum ``equation`` with ``...`` spelled out as one
    character per broadcast dim (aligned from the right, as torch does) and an implicit output made
    explicit (the broadcast dims, then the letters used once, sorted); None if it does not parse."""
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ndims):
        return None
    width = max((nd - (len(t) - 3) for t, nd in zip(terms, ndims) if "..." in t), default=0)
    ell = "".join(chr(0x391 + i) for i in range(width))  # Greek capitals: never einsum letters
    out = []
    for t, nd in zip(terms, ndims):
        if "..." in t:
            n = nd - (len(t) - 3)
            if n < 0:
                return None
            t = t.replace("...", ell[width - n:] if n else "")
        out.append(t)
    if arrow:
        rhs = rhs.replace("...", ell)
    else:
        letters = "".join(t for t in terms).replace("...", "")
        rhs = ell + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return out, rhs


@annotation_rule("aten.einsum.default")
def einsum_rule(call: OpCall):
    """Any einsum whose operands repeat no letter: one identifier per letter, shared by every operand
    that has it (a length-1 dim broadcasts, written ``1``); a letter the output lacks is contracted,
    split by value (``+``: each rank sums its slice, the results are partial sums), as ``k`` of
    ``linear``. ``bind,bjnd->bnij`` is ``b i n d+, b j n d+ -> b n i j``."""
    if not usable(call) or len(call.args) < 2 or not isinstance(call.args[0], str):
        return None
    ops = call.args[1]
    if not isinstance(ops, (list, tuple)) or not ops or not all(isinstance(t, TensorMeta) for t in ops):
        return None
    parsed = _einsum_terms(call.args[0], [t.ndim for t in ops])
    if parsed is None:
        return None
    terms, rhs = parsed
    sizes: dict[str, int] = {}
    for term, t in zip(terms, ops):
        if len(term) != t.ndim or len(set(term)) != len(term):
            return None  # a diagonal (``ii->i``) is no split of either dim
        for c, n in zip(term, t.shape):
            if n != 1 and sizes.setdefault(c, n) != n:
                return None
    if len(set(rhs)) != len(rhs) or not set(rhs) <= set("".join(terms)):
        return None
    names = Names()
    ids = {c: names.dim(n) for c, n in sizes.items()}

    def dim(c: str, n: int) -> str:
        return "1" if n == 1 else ids[c] if c in rhs else mark(ids[c], "+")
    ins = {1: [[dim(c, n) for c, n in zip(term, t.shape)] for term, t in zip(terms, ops)]}
    out = [ids.get(c, "1") for c in rhs]
    if [sizes.get(c, 1) for c in rhs] != list(call.outputs[0].shape):
        return None
    return build(call, FAMILY, ins, [out])
