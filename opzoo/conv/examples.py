"""Verified example calls of the conv rules (:mod:`opzoo.conv.rules`), each registered as a zoo entry
``rule.<op>.<i>`` by :func:`opzoo.rulekit.register_examples`: convolutions (grouped, depthwise, ``same``
padding, transposed), group norm, pools.

The harness samples its own lengths from the derived annotations.
"""
from __future__ import annotations

from ..rulekit import T, register_examples

register_examples("aten.conv2d.default", [(T(4, 3, 8, 8), T(12, 3, 3, 3), T(12), [1, 1], [1, 1]),
                                          (T(4, 12, 8, 8), T(24, 12, 3, 3), None, [2, 2], [1, 1]),
                                          (T(4, 3, 8, 8), T(6, 3, 4, 4), T(6), [4, 4]),
                                          (T(4, 1, 8, 8), T(6, 1, 3, 3), T(6))])  # one input channel, a bias
register_examples("aten.conv1d.default", [(T(4, 6, 9), T(8, 6, 3), T(8), [1], [1]), (T(2, 4, 10), T(6, 4, 2)),
                                          (T(4, 12, 9), T(12, 4, 3), T(12), [1], [1], [1], 3),  # grouped
                                          (T(4, 8, 10), T(8, 1, 5), None, [1], [2], [1], 8)])  # depthwise
register_examples("aten.conv1d.padding", [(T(4, 6, 9), T(8, 6, 3), T(8), [1], "same"),
                                          (T(4, 12, 16), T(12, 4, 3), None, [1], "same", [2], 3)])
register_examples("aten.conv2d.padding", [(T(4, 6, 8, 8), T(12, 2, 3, 3), T(12), [1, 1], "same", [1, 1], 3)])
register_examples("aten.group_norm.default", [(T(4, 12, 8, 8), 3, T(12), T(12), 1e-5, False),
                                              (T(4, 6, 5), 6, T(6), T(6)), (T(2, 6, 4, 4), 1, T(6), T(6), 1e-5, True),
                                              (T(4, 12, 5), 3)])
register_examples("aten.conv_transpose1d.default", [(T(4, 6, 9), T(6, 8, 4), T(8), [2]),
                                                    (T(4, 6, 9), T(6, 2, 3), None, [1], [1], [0], 3)])
register_examples("aten.conv_transpose2d.input", [(T(2, 4, 5, 5), T(4, 6, 3, 3), T(6), [2, 2], [1, 1], [1, 1]),
                                                  (T(2, 8, 4, 4), T(8, 3, 2, 2), T(12), [2, 2], [0, 0], [0, 0], 4)])
register_examples("aten.avg_pool1d.default", [(T(2, 4, 8), [2]), (T(4, 6, 9), [3], [2], [1])])
register_examples("aten.avg_pool2d.default", [(T(2, 4, 8, 8), [2, 2])])
register_examples("aten.max_pool1d.default", [(T(2, 4, 8), [2])])
register_examples("aten.max_pool2d.default", [(T(2, 4, 8, 8), [3, 3], [2, 2], [1, 1])])
register_examples("aten.adaptive_avg_pool1d.default", [(T(2, 4, 8), [1]), (T(4, 6, 9), [3])])
register_examples("aten.adaptive_avg_pool2d.default", [(T(2, 4, 8, 8), [1, 1])])
register_examples("aten.conv_transpose3d.input", [(T(2, 3, 3, 4, 4), T(3, 4, 2, 2, 2), None, [2, 2, 2])])
