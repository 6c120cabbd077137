"""Linear algebra. The contracted dim is split by value (``k+``): each rank multiplies its slice
and the results are partial sums. A bias or ``input`` term lacking ``k`` is made a partial value
(held by one rank) under that split, so ``linear`` with bias, ``addmm`` and ``baddbmm`` stay exact."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nnscaler import register_op

FAMILY = "linalg"


def _reg(name, annotation, fn, aten, **options):
    register_op(annotation, name, family=FAMILY, aten=aten, **options)(fn)


_reg("linear", "* k+, n k+ -> * n", F.linear, "aten.linear.default")
_reg("linear_bias", "* k+, n k+, +n -> * n", F.linear, "aten.linear.default")
_reg("matmul", "* m k+, k+ n -> * m n", torch.matmul, "aten.matmul.default")
_reg("matmul_batched", "* m k+, * k+ n -> * m n", torch.matmul, "aten.matmul.default", star=1)
_reg("matmul_vec", "* m k+, k+ -> * m", torch.matmul, "aten.matmul.default", star=1)
_reg("mm", "m k+, k+ n -> m n", torch.mm, "aten.mm.default")
_reg("bmm", "b m k+, b k+ n -> b m n", torch.bmm, "aten.bmm.default")
_reg("addmm", "+n, m k+, k+ n -> m n", torch.addmm, "aten.addmm.default")
_reg("baddbmm", "+b m n, b m k+, b k+ n -> b m n", torch.baddbmm, "aten.baddbmm.default",
     kwargs={"beta": 0.5, "alpha": 2.0})
_reg("mv", "m k+, k+ -> m", torch.mv, "aten.mv.default")
_reg("dot", "k+, k+ -> 1", torch.dot, "aten.dot.default")
_reg("outer", "m, n -> m n", torch.outer, "aten.outer.default")

EINSUM = {  # name: (equation, annotation of the operands -> result)
    "einsum_bmm": ("bij,bjk->bik", "b i j+, b j+ k -> b i k"),
    "einsum_scores": ("bhid,bhjd->bhij", "b h i d+, b h j d+ -> b h i j"),
    "einsum_linear": ("bsk,nk->bsn", "b s k+, n k+ -> b s n"),
}
for _name, (_eq, _anno) in EINSUM.items():
    _reg(_name, "?, " + _anno, torch.einsum, "aten.einsum.default", args={0: _eq})
