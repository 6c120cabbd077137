"""Verified example calls of the writes rules (:mod:`opzoo.writes.rules`), each registered as a zoo entry
``rule.<op>.<i>`` by :func:`opzoo.rulekit.register_examples`: functionalized writes into a slice (T5's
``_shift_right``): slice/select scatter, copy, fill.

The harness samples its own lengths from the derived annotations.
"""
from __future__ import annotations

from ..rulekit import I, INT_MAX, T, register_examples

register_examples("aten.slice_scatter.default", [(T(4, 8), T(4, 7), 1, 1, INT_MAX), (T(6, 4, 3), T(2, 4, 3), 0, 0, 2),
                                                 (I(4, 8), I(4, 8), 1)])
register_examples("aten.select_scatter.default", [(T(4, 8), T(4), 1, 0), (T(3, 4, 5), T(4, 5), 0, -1)])
register_examples("aten.copy.default", [(T(4, 7), T(4, 7)), (I(4, 6), I(6))])
register_examples("aten.fill.Tensor", [(I(4,), I()), (T(4, 8), T())])
register_examples("aten.fill.Scalar", [(T(4, 8), 0.5)])
