"""Verified example calls of the slicing rules (:mod:`opzoo.slicing.rules`), each registered as a zoo entry
``rule.<op>.<i>`` by :func:`opzoo.rulekit.register_examples`: splits, slices, pads, selects, concatenations
(key/value caches' empty first tensor), rolls.

The harness samples its own lengths from the derived annotations.
"""
from __future__ import annotations

from ..rulekit import I, INT_MAX, T, register_examples

register_examples("aten.split.Tensor", [(T(2, 8, 96), 32, 2), (T(12, 8), 4), (T(2, 10), 4, -1)])
register_examples("aten.split_with_sizes.default", [(T(2, 8, 96), [32, 32, 32], -1), (T(2, 5), [2, 3], 1)])
register_examples("aten.chunk.default", [(T(2, 8, 12), 3, -1), (T(8, 2), 2), (T(2, 7), 3, 1)])
register_examples("aten.unbind.int", [(T(3, 8, 2, 32), 0), (T(4, 6, 2), -1)])
register_examples("aten.slice.Tensor", [
    (T(2, 4, 8, 8), 3, 0, 4), (T(2, 4, 8, 8), 3, 4, INT_MAX), (I(2, 9), 1, 1, INT_MAX),
    (T(2, 8), 1, 0, INT_MAX), (T(6, 8), 0, 1, 5, 2), (T(2, 8), 1, 0, 8), (T(4, 6), -1, -3)])
register_examples("aten.pad.default", [(I(2, 8), [0, 1], "constant", -100.0), (T(2, 4, 6), [1, 2, 0, 0]),
                                       (T(2, 4, 6), [1, 1, 2, 0], "reflect")])
register_examples("aten.select.int", [(T(3, 8, 2, 32), 0, 1), (T(2, 5, 4), -2, -1)])
register_examples("aten.cat.default", [([T(2, 4, 8, 4), T(2, 4, 8, 4)], -1), ([T(3, 8), T(5, 8)],),
                                       ([T(2, 3, 4), T(2, 1, 4), T(2, 2, 4)], 1)])
register_examples("aten.stack.default", [([T(2, 8), T(2, 8)],), ([T(4, 3), T(4, 3), T(4, 3)], -1)])
register_examples("aten.slice.Tensor", [(T(4, 3, 8, 16), 3, 16, INT_MAX)])
register_examples("aten.cat.default", [([T(4, 3, 8, 16), T(4, 3, 8, 0)], -1)])
register_examples("aten.cat.default", [([T(0), T(4, 2, 8, 16)], -2), ([T(0), T(4, 6), T(4, 2)], 1)])
register_examples("aten.concatenate.default", [([T(4, 2, 4, 16), T(4, 2, 4, 16)], 2), ([T(0), T(3, 8)],)])
register_examples("aten.roll.default", [(T(2, 6, 6, 8), [3, -3], [1, 2]), (T(4, 8), [2]), (T(4, 6, 5), [1], [-1])])
register_examples("aten.slice.Tensor", [(T(2, 4, 12), -1, 1, INT_MAX, 2), (T(6, 8), 0, 0, 6, 3), (T(2, 8), 1, 0, 8, 2)])
register_examples("aten.concat.default", [([T(2, 3, 4), T(2, 3, 4)], -1)])
