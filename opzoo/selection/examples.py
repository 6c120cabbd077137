"""Verified example calls of the selection rules (:mod:`opzoo.selection.rules`), each registered as a zoo entry
``rule.<op>.<i>`` by :func:`opzoo.rulekit.register_examples`: max/min along a dim, argmax/argmin, amax/amin,
tril/triu, scatter, repeat, ``*_as`` views.

The harness samples its own lengths from the derived annotations.
"""
from __future__ import annotations

from ..rulekit import I, T, register_examples

register_examples("aten.max.dim", [(T(4, 4, 8, 8), -1, True), (T(4, 6), 0)])
register_examples("aten.min.dim", [(T(4, 6, 5), 1)])
register_examples("aten.argmax.default", [(T(4, 6), 1), (T(4, 6, 5), -1, True), (T(4, 6),)])
register_examples("aten.argmin.default", [(T(4, 6), 0)])
register_examples("aten.amax.default", [(T(4, 6, 5), [1, 2]), (T(4, 6), [-1], True)])
register_examples("aten.amin.default", [(T(4, 6), [0])])
register_examples("aten.tril.default", [(T(4, 2, 6, 6), -1), (T(5, 7),)])
register_examples("aten.triu.default", [(T(3, 6, 6), 1)])
register_examples("aten.scatter.value", [(T(32, 4), 1, I(32, 1), 1.0), (T(6, 4, 5), 0, I(3, 4, 5), -2.0)])
register_examples("aten.scatter.src", [(T(32, 4), 1, I(32, 2), T(32, 2))])
register_examples("aten.repeat.default", [(T(32, 6), [4, 1]), (T(4, 6), [2, 1, 3]), (T(4, 6), [1, 1])])
register_examples("aten.reshape_as.default", [(T(4, 4, 8, 8, 2), T(4, 4, 8, 16)), (T(4, 6), T(24))])
register_examples("aten.view_as.default", [(T(4, 2, 3), T(4, 6))])
