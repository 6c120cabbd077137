"""Shape and layout operators. Shape arguments are ``Size`` expressions, so under a partition they
resolve to the rank's local lengths and the op on a shard is the shard of the op. A dim built from
several identifiers is a group ``(a b)`` (only its first factor may be split); dims whose length is
an argument or a sum of lengths (``cat``, ``narrow``, ``slice``) are frozen."""
from __future__ import annotations

import torch

from nnscaler import Size, register_op

FAMILY = "shape"


def _reg(name, annotation, fn, aten, **options):
    register_op(annotation, name, family=FAMILY, aten=aten, **options)(fn)


def cat(x, y, dim=-1):
    return torch.cat([x, y], dim)


def stack(x, y, dim=0):
    return torch.stack([x, y], dim)


def slice_dim(x, dim, start, end):
    return x[(slice(None),) * (dim % x.dim()) + (slice(start, end),)]


_reg("view", "a b c, ? -> a (b c)", torch.Tensor.view, "aten.view.default", args={1: Size("a (b c)")})
_reg("view_split", "a (b c), ? -> a b c", torch.Tensor.view, "aten.view.default", args={1: Size("a b c")})
_reg("view_infer", "a b c, ? -> a (b c)", torch.Tensor.view, "aten.view.default", args={1: Size("a -1")})
_reg("reshape", "a b c, ? -> (a b c)", torch.reshape, "aten.reshape.default", args={1: (Size("(a b c)"),)})
_reg("reshape_split", "(a b) c, ? -> a b c", torch.reshape, "aten.reshape.default", args={1: Size("a b c")})
_reg("unflatten", "a (b c), ?, ? -> a b c", torch.unflatten, "aten.unflatten.int",
     args={1: -1, 2: Size("b c")})
_reg("flatten", "a b c, ?, ? -> a (b c)", torch.flatten, "aten.flatten.using_ints", args={1: 1, 2: -1})
_reg("permute", "a b c, ? -> c a b", torch.permute, "aten.permute.default", args={1: (2, 0, 1)})
_reg("transpose", "* m n, ?, ? -> * n m", torch.transpose, "aten.transpose.int", args={1: -2, 2: -1})
_reg("t", "m n -> n m", torch.t, "aten.t.default")
_reg("expand", "a 1 c, ? -> a b c", torch.Tensor.expand, "aten.expand.default", args={1: Size("a b c")},
     sizes={"b": 12})
_reg("expand_new_dim", "a c, ? -> b a c", torch.Tensor.expand, "aten.expand.default",
     args={1: Size("b a c")}, sizes={"b": 8})
_reg("unsqueeze", "a b, ? -> a 1 b", torch.unsqueeze, "aten.unsqueeze.default", args={1: 1})
_reg("squeeze", "a 1 b, ? -> a b", torch.squeeze, "aten.squeeze.dim", args={1: 1})
_reg("clone", "* -> *", torch.clone, "aten.clone.default")
_reg("contiguous", "* -> *", torch.Tensor.contiguous, "aten.contiguous.default")
_reg("cat", "a n^, a m^ -> a o^", cat, "aten.cat.default")
_reg("cat_dim0", "n^ a, m^ a -> o^ a", cat, "aten.cat.default", kwargs={"dim": 0})
_reg("stack", "a b, a b -> 2 a b", stack, "aten.stack.default")
_reg("stack_last", "a b, a b -> a b 2", stack, "aten.stack.default", kwargs={"dim": -1})
_reg("split", "a (3 n), ? -> a n, a n, a n", torch.split, "aten.split.Tensor", args={1: Size("n")},
     kwargs={"dim": -1})
_reg("split_with_sizes", "a n^, ? -> a p^, a q^", torch.split, "aten.split_with_sizes.default",
     args={1: [2, 3]}, sizes={"n": 5}, kwargs={"dim": -1})
_reg("chunk", "a (2 n), ? -> a n, a n", torch.chunk, "aten.chunk.default", args={1: 2}, kwargs={"dim": -1})
_reg("chunk_dim0", "(2 n) b, ? -> n b, n b", torch.chunk, "aten.chunk.default", args={1: 2})
_reg("unbind", "2 a b, ? -> a b, a b", torch.unbind, "aten.unbind.int", args={1: 0})
_reg("narrow", "a n^, ?, ?, ? -> a m^", torch.narrow, "aten.narrow.default", args={1: -1, 2: 1, 3: 2})
_reg("slice", "a n^, ?, ?, ? -> a m^", slice_dim, "aten.slice.Tensor", args={1: 1, 2: 1, 3: 3})
_reg("select", "a n^, ?, ? -> a", torch.select, "aten.select.int", args={1: 1, 2: 1})
