"""Verified example calls of the reduction rules (:mod:`opzoo.reduction.rules`), each registered as a zoo entry
``rule.<op>.<i>`` by :func:`opzoo.rulekit.register_examples`: sums and means over one or several dims
(keepdim, ``None``, ``[]``), softmaxes, cumsum, variances; whole maxima, minima, any and all of integer and boolean tensors (and of floating ones, read whole).

The harness samples its own lengths from the derived annotations.
"""
from __future__ import annotations

import torch

from ..rulekit import B, I, T, ex, register_examples

register_examples("aten.sum.dim_IntList", [(T(2, 8, 32), [-1]), (T(2, 8, 32), [0, 2], True),
                                           (T(2, 3, 4, 5), [1, -1]), (T(4, 6), None), (T(4, 1, 6), [1])])
register_examples("aten.sum.default", [(T(4, 8),), (T(2, 3, 4),)])
register_examples("aten.mean.dim", [(T(2, 8, 32), [-1], True), (T(2, 8, 32), [0, 2]), (T(4, 6, 8), [1]),
                                    (T(4, 6), [])])
register_examples("aten.mean.default", [(T(4, 8),)])
register_examples("aten.softmax.int", [(T(2, 4, 8, 8), -1), (T(4, 8, 6), 1), (T(2, 4, 8, 8), -1, torch.float32)])
register_examples("aten.log_softmax.int", [(T(4, 8), 0), (T(2, 3, 8), -1)])
register_examples("aten._softmax.default", [(T(4, 8), -1, False)])
register_examples("aten.cumsum.default", [(T(4, 8), 0), (B(2, 8), -1)])
register_examples("aten.var.dim", [(T(4, 8, 2, 16), [-1], False, True), (T(4, 8), [0])])
register_examples("aten.var.correction", [ex(T(4, 8, 6), [1, 2], correction=0, keepdim=True), (T(4, 8),)])
register_examples("aten.std.correction", [ex(T(4, 8), [-1], correction=1)])
register_examples("aten.std.dim", [(T(3, 8, 5), [1], True, False)])
register_examples("aten.max.default", [(I(4, 8),), (I(8,),), (T(4, 8),)])
register_examples("aten.min.default", [(I(4, 6, 2),), (T(3, 8),)])
register_examples("aten.any.default", [(B(4, 8),), (B(2, 1, 8),)])
register_examples("aten.all.default", [(B(4, 8),)])
