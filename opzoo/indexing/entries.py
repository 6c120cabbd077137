"""Indexing, selection and scans. ``index_select`` and ``gather`` split the indexed dim by value
with a masked local lookup (indices outside a rank's range give zeros, the partial values sum to
the result); ``scatter_add`` splits its sources by value (``self`` is then held by one rank).
Scans (``cumsum``, ``cumprod``), sorting, ``flip`` and triangles keep their dims frozen."""
from __future__ import annotations

from functools import partial

import torch

from nnscaler import Index, Mask, register_op

from .. import kernels as K

FAMILY = "indexing"


def _reg(name, annotation, fn, aten, **options):
    register_op(annotation, name, family=FAMILY, aten=aten, **options)(fn)


_reg("index_select", "v+ h, ?, k -> k h", torch.index_select, "aten.index_select.default", args={1: 0},
     inputs={2: Index("v")}, local=partial(K.index_select, ident="v"))
_reg("index_select_dim1", "a v+, ?, k -> a k", torch.index_select, "aten.index_select.default",
     args={1: 1}, inputs={2: Index("v")}, local=partial(K.index_select, ident="v"))
_reg("gather", "a n+, ?, a k -> a k", torch.gather, "aten.gather.default", args={1: -1},
     inputs={2: Index("n")}, local=partial(K.gather, ident="n"))
_reg("scatter_add", "+a n^, ?, a k+, a k+ -> a n^", torch.scatter_add, "aten.scatter_add.default",
     args={1: -1}, inputs={2: Index("n")})

_reg("where", "*, *, * -> *", torch.where, "aten.where.self", inputs={0: Mask()})
_reg("where_bcast", "s t, * s t, * s t -> * s t", torch.where, "aten.where.self", inputs={0: Mask()})
_reg("where_scalar", "*, *, ? -> *", torch.where, "aten.where.ScalarOther", inputs={0: Mask()},
     args={2: 0.0})
_reg("masked_fill", "*, *, ? -> *", torch.masked_fill, "aten.masked_fill.Scalar", inputs={1: Mask()},
     args={2: -1.0})
_reg("masked_fill_bcast", "* s t, s t, ? -> * s t", torch.masked_fill, "aten.masked_fill.Scalar",
     inputs={1: Mask()}, args={2: -1e4})

_reg("cumsum", "* n^, ? -> * n^", torch.cumsum, "aten.cumsum.default", args={1: -1})
_reg("cumsum_dim0", "n^ *, ? -> n^ *", torch.cumsum, "aten.cumsum.default", args={1: 0})
_reg("cumprod", "* n^, ? -> * n^", torch.cumprod, "aten.cumprod.default", args={1: -1})
_reg("logcumsumexp", "* n^, ? -> * n^", torch.logcumsumexp, "aten.logcumsumexp.default", args={1: -1})
_reg("flip", "* n^, ? -> * n^", torch.flip, "aten.flip.default", args={1: (-1,)})
_reg("roll", "* n^, ?, ? -> * n^", torch.roll, "aten.roll.default", args={1: 1, 2: -1})
_reg("tril", "* m^ n^ -> * m^ n^", torch.tril, "aten.tril.default")
_reg("triu", "* m^ n^ -> * m^ n^", torch.triu, "aten.triu.default", kwargs={"diagonal": 1})
_reg("topk", "* n^, ? -> * k^, * k^", torch.topk, "aten.topk.default", args={1: 2})
_reg("sort", "* n^ -> * n^, * n^", torch.sort, "aten.sort.default", kwargs={"dim": -1})
