"""Verified example calls of the creation rules (:mod:`opzoo.creation.rules`), each registered as a zoo entry
``rule.<op>.<i>`` by :func:`opzoo.rulekit.register_examples`: factories, ``new_*`` and ``*_like`` tensors,
``type_as``, metadata asserts.

The harness samples its own lengths from the derived annotations.
"""
from __future__ import annotations

import torch

from ..rulekit import B, I, T, ex, register_examples

I64, BOOL = torch.int64, torch.bool

_CPU = torch.device("cpu")
register_examples("aten.arange.default", [ex(8, device=_CPU, pin_memory=False), ex(1), ex(6, dtype=torch.float32)])
register_examples("aten.arange.start", [(2, 9)])
register_examples("aten.arange.start_step", [(0, 12, 3)])
register_examples("aten.zeros.default", [ex([], dtype=torch.float32), ex([4, 6])])
register_examples("aten.ones.default", [ex([3, 4], dtype=torch.bool)])
register_examples("aten.full.default", [([2, 5], -1.5), ex([], 7, dtype=I64)])
register_examples("aten.empty.memory_format", [ex([4, 3], dtype=torch.float32)])
register_examples("aten.scalar_tensor.default", [ex(2.5, dtype=torch.float32)])
register_examples("aten.new_ones.default", [ex(I(1, 1, 8, 1), [], dtype=BOOL), (T(4, 8), [2, 3])])
register_examples("aten.new_zeros.default", [(T(4, 8), [6]), (I(4, 8), [4, 8])])
register_examples("aten.new_full.default", [(T(4, 8), [2, 2], 3.0)])
register_examples("aten.new_empty.default", [(T(4, 8), [3, 2])])
register_examples("aten.empty_like.default", [ex(I(64), pin_memory=False), (T(4, 8),)])
register_examples("aten.zeros_like.default", [(T(2, 8, 6),)])
register_examples("aten.ones_like.default", [(I(4, 8),)])
register_examples("aten.full_like.default", [(T(4, 8), -2.0)])
register_examples("aten.type_as.default", [(T(4, 8, 6), T(4, 8, 6)), (T(4, 8), T(3, dtype=torch.float64)),
                                           (T(2, 8), I(5))])
register_examples("aten._assert_tensor_metadata.default", [
    ex(T(4, 8, 6), dtype=torch.float32, device=_CPU, layout=torch.strided), ex(B(4, 1, 8, 8), dtype=BOOL),
    ex(T(8), None, None, torch.float32)])
