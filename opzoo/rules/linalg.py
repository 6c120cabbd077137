"""Rules for ``linear`` and ``matmul`` at any batch rank, as :mod:`opzoo.linalg` splits them: the
contracted dim is split by value (``k+``, results are partial sums; a bias, written ``+n``, is then
held by one rank), every other dim is spatial; ``matmul``'s batch dims broadcast like an
element-wise op (``1`` where one side broadcasts), and 1-d operands follow ``torch.matmul``.
"""
from __future__ import annotations

from nnscaler.ops import OpCall, TensorMeta, annotation_rule

from ._common import Names, broadcast, build, mark, usable

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
