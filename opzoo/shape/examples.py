"""Verified example calls of the shape rules (:mod:`opzoo.shape.rules`), each registered as a zoo entry
``rule.<op>.<i>`` by :func:`opzoo.rulekit.register_examples`: views and reshapes (split and merged dims,
``-1``, length-1 dims), transposes, expands, complex views.

The harness samples its own lengths from the derived annotations.
"""
from __future__ import annotations

import torch

from ..rulekit import B, T, register_examples

register_examples("aten.view.default", [
    (T(2, 8, 32), [2, 8, 4, 8]), (T(2, 8, 4, 8), [2, 8, 32]), (T(2, 8, 64), [-1, 64]),
    (T(8, 2, 32), [8, 8, 8]), (T(2, 6, 4), [2, 4, 6]), (T(2, 1, 8), [2, 8, 1]), (T(2, 8), [-1])])
register_examples("aten.reshape.default", [
    (T(8, 2, 4, 8), [16, 32]), (T(2, 8, 4, 8), [2, 8, -1]), (T(2, 2, 2, 8, 8), [2, 4, 8, 8]),
    (T(2, 2, 4, 8, 16), [2, 8, 8, 16]), (T(2, 1, 4, 8, 16), [2, 4, 8, 16])])  # repeat_kv: (kv heads, repeats) -> heads
register_examples("aten._unsafe_view.default", [(T(4, 6), [24]), (T(24,), [2, 3, 4])])
register_examples("aten.flatten.using_ints", [(T(2, 3, 4, 5), 1, 2), (T(2, 8, 4), 0, -1), (T(4, 6),)])
register_examples("aten.unflatten.int", [(T(8, 2, 96), -1, [3, 32]), (T(2, 12), 1, [-1, 4]),
                                         (T(12, 5), 0, [1, 12])])
register_examples("aten.squeeze.dim", [(T(3, 8, 2, 1, 32), -2), (T(2, 8), 0), (T(4, 1), 0)])
register_examples("aten.squeeze.dims", [(T(1, 4, 1, 8), [0, 2]), (T(4, 1, 8), [0, 1])])
register_examples("aten.squeeze.default", [(T(2, 1, 8, 1),)])
register_examples("aten.unsqueeze.default", [(T(2, 8), 1), (T(8), 0), (T(2, 8), -1)])
register_examples("aten.transpose.int", [(T(2, 8, 4, 8), 1, 2), (T(1, 8, 2, 3, 32), 0, -2),
                                         (T(2, 4, 8, 6), -1, -2)])
register_examples("aten.permute.default", [(T(2, 4, 8, 6), [2, 0, 1, 3]), (T(2, 3, 4), [-1, 0, 1])])
register_examples("aten.t.default", [(T(4, 8),), (T(8),)])
register_examples("aten.expand.default", [(T(1, 8), [12, -1]), (T(8, 1), [8, 12]), (T(4, 8), [12, 4, 8]),
                                          (B(2, 1, 8, 1), [2, -1, 8, 8]),
                                          (T(2, 2, 1, 8, 16), [2, 2, 4, 8, 16])])  # repeat_kv's repeats
register_examples("aten.view_as_complex.default", [(T(4, 8, 4, 8, 2),)])
register_examples("aten.view_as_real.default", [(T(4, 8, 4, 8, dtype=torch.complex64),)])
register_examples("aten.as_strided.default", [
    (T(8, 16, 16, 1), [16, 1, 8, 16], [16, 128, 256, 1]),  # Longformer's query chunks, one chunk: (b h), window, d
    (T(2, 8, 16, 16), [16, 3, 8, 16], [16, 1024, 256, 1]),  # three overlapping chunks: the window stays whole
    (T(16, 16, 16), [16, 2, 12, 16], [256, 64, 16, 1]),  # Longformer's padded value chunks
    (T(8, 4, 8), [3, 4, 4, 8], [64, 32, 8, 1])])  # tests/fixtures/strided_chunks.py's windows of a (seq, batch, width)
