"""Verified example calls of the nn rules (:mod:`opzoo.nn.rules`), each registered as a zoo entry
``rule.<op>.<i>`` by :func:`opzoo.rulekit.register_examples`: layer and RMS norms (weights given or None),
embeddings, attention (masks, GQA, a scale).

The harness samples its own lengths from the derived annotations.
"""
from __future__ import annotations

from ..rulekit import B, I, T, ex, register_examples

register_examples("aten.layer_norm.default", [
    (T(2, 8, 32), [32], T(32), T(32), 1e-5, False), (T(4, 6, 8), [6, 8], T(6, 8), T(6, 8)), (T(4, 8), [8]),
    (T(4, 8), [8], None, T(8))])
register_examples("aten.rms_norm.default", [(T(2, 8, 32), [32], T(32), 1e-6), (T(4, 8), [8])])
register_examples("aten.embedding.default", [(T(64, 32), I(2, 8)), (T(16, 32), I(8)), (T(64, 32), I(2, 8), 0)])
_Q = T(2, 4, 8, 8)
register_examples("aten.scaled_dot_product_attention.default", [
    (_Q, _Q, _Q, None, 0.0, True), (_Q, _Q, _Q), (_Q, _Q, _Q, T(2, 1, 8, 8)), (T(2, 4, 6, 8), T(2, 4, 10, 8),
                                                                            T(2, 4, 10, 5), T(6, 10)),
    (_Q, _Q, _Q, B(8, 8)), ex(_Q, T(2, 2, 8, 8), T(2, 2, 8, 8), enable_gqa=True),
    ex(T(4, 6, 8), T(4, 6, 8), T(4, 6, 8), scale=0.3)])
