"""Verified example calls of the elementwise rules (:mod:`opzoo.elementwise.rules`), each registered as a zoo
entry ``rule.<op>.<i>`` by :func:`opzoo.rulekit.register_examples`: unary and binary ops (broadcasting from
the left and with 1s, 0-d tensors, scalars), casts, dropout, random draws shaped like their input.

The harness samples its own lengths from the derived annotations.
"""
from __future__ import annotations

import torch

from ..rulekit import B, I, T, ex, register_examples

register_examples("aten.contiguous.default", [(T(2, 8, 4, 8),)])
register_examples("aten.clone.default", [(T(2, 8, 6),)])
register_examples("aten.alias.default", [(T(2, 8),)])
_SHAPES = [(2, 8, 6), (8,), (4, 1, 6), (3, 5)]
_UNARY = ["neg", "exp", "log", "rsqrt", "sqrt", "abs", "sin", "erf", "reciprocal", "relu", "gelu", "silu",
          "tanh", "sigmoid", "log_sigmoid"]
for _i, _op in enumerate(_UNARY):
    register_examples(f"aten.{_op}.default", [(T(*_SHAPES[_i % len(_SHAPES)]),)])
register_examples("aten.gelu.default", [ex(T(4, 8), approximate="tanh")])
register_examples("aten.neg.default", [(T(),)])
register_examples("aten.leaky_relu.default", [(T(4, 8), 0.1)])
register_examples("aten.hardtanh.default", [(T(4, 8), -0.5, 0.5)])
register_examples("aten.clamp.default", [(T(4, 8), -0.5, 0.5), ex(T(4, 8), max=0.2)])
register_examples("aten.add.Tensor", [
    (T(2, 8, 32), T(8, 32)), (T(2, 4, 8, 8), T(2, 1, 8, 8)), (T(2, 8, 1), 1e-6), (T(8), T(2, 1)),
    ex(T(2, 8), T(2, 8), alpha=2), (I(8), 0)])
register_examples("aten.sub.Tensor", [(T(2, 1), 1), (T(4, 8), T(4, 1)), (T(), T(3, 4))])
register_examples("aten.mul.Tensor", [(T(32), T(2, 8, 32)), (T(2, 4, 8, 8), T(1, 1, 8, 8)), (T(2, 8, 12), 0.5)])
register_examples("aten.div.Tensor", [(T(2, 8), T(8)), (T(4, 8), 3.0), (T(4, 1, 8), T(4, 6, 1))])
register_examples("aten.pow.Tensor_Scalar", [(T(2, 8, 32), 2), (T(4, 8), 0.5)])
register_examples("aten.rsub.Scalar", [(T(4, 8), 1.0)])
register_examples("aten.maximum.default", [(T(4, 8), T(8))])
register_examples("aten.minimum.default", [(T(4, 1), T(1, 8))])
register_examples("aten.min.other", [(T(4, 8), T(4, 8))])
register_examples("aten.max.other", [(T(4, 1), T(1, 8))])
register_examples("aten.where.self", [(B(2, 1, 8, 8), T(2, 4, 8, 8), T(8)), (B(4, 8), T(4, 8), T())])
register_examples("aten.where.ScalarOther", [(B(2, 1, 8, 8), T(), -3.0), (B(4, 8), T(4, 8), 0.0)])
register_examples("aten.masked_fill.Scalar", [(T(2, 4, 8, 8), B(8, 8), -1e4)])
register_examples("aten.eq.Tensor", [(I(2, 1, 8, 1), I(2, 1, 1, 8))])
register_examples("aten.le.Tensor", [(I(2, 1, 1, 8), I(2, 1, 8, 1))])
register_examples("aten.ne.Scalar", [(I(2, 8), 1)])
register_examples("aten.ge.Scalar", [(I(1, 1, 8, 1), 0)])
register_examples("aten.__and__.Tensor", [(B(), B(2, 1, 8, 8)), (B(2, 8), B(2, 8))])
register_examples("aten.to.dtype", [(T(2, 8, 32), torch.float32), (T(4, 8), torch.float64)])
register_examples("aten.to.dtype_layout", [ex(T(16, 4), dtype=torch.float32, layout=torch.strided,
                                              device=torch.device("cpu"))])
register_examples("aten._to_copy.default", [ex(T(4, 8), dtype=torch.float64)])
register_examples("aten.to.device", [(T(4, 8), torch.device("cpu"), torch.float64)])
register_examples("aten.dropout.default", [(T(2, 8, 32), 0.0, True), (T(2, 4, 8, 8), 0.1, False), (T(4, 6, 8), 0.25, True)])
register_examples("aten.floor_divide.default", [(I(64), 2), (T(4, 8), T(8))])
register_examples("aten.div_.Tensor", [(T(32, 2), T(32, 1))])
register_examples("aten.mul_.Tensor", [(T(4, 8), 0.5)])
register_examples("aten.broadcast_tensors.default", [([T(4, 8, 6), T(4, 8, 6)],), ([T(4, 1), T(1, 6)],)])
register_examples("aten.rand_like.default", [(T(4, 6, 8),)])
register_examples("aten.uniform.default", [(T(4, 6), 0.9, 1.1)])
register_examples("aten.exponential.default", [(T(2, 8, 6),)])
