"""Verified example calls of the indexing rules (:mod:`opzoo.indexing.rules`), each registered as a zoo entry
``rule.<op>.<i>`` by :func:`opzoo.rulekit.register_examples`: index, gather, index_select, index_put, diff,
repeat_interleave, topk and sort.

The harness samples its own lengths from the derived annotations.
"""
from __future__ import annotations

from ..rulekit import B, I, T, ex, register_examples

register_examples("aten.index.Tensor", [(T(64, 48), [I(64)]), (T(3, 12, 8), [I(16)]),
                                        (I(4, 8), [I(4, 1, 1, 1), I(1, 1, 8, 1)]), (T(10,), [I(4, 6)]),
                                        (T(4, 8, 6, 16), [None, None, I(2)])])
register_examples("aten.gather.default", [(T(4, 4, 8, 24), -1, I(4, 4, 8, 8)), (T(12, 6), 0, I(4, 6)),
                                          (T(8, 16), 1, I(8, 16))])
register_examples("aten.index_select.default", [(T(4, 8, 15), 2, I(8)), (T(12, 6), 0, I(5)), (T(6, 12), -1, I(12))])
register_examples("aten.index_put.default", [(I(16), [I(16)], I(16)), (T(8, 4), [I(6)], T(6, 4), True),
                                            (I(4, 8), [B(4, 8)], I()), (T(4, 8, 6), [B(4, 8)], T(1), True),
                                            (T(4, 8, 6), [B(4, 8)], T(6))])
register_examples("aten.index_put_.default", [(I(16), [I(16)], I(16))])
register_examples("aten.diff.default", [(I(4, 8), 1, -1, I(4, 1)), (T(6, 5),), (T(4, 7), 1, 0, None, T(1, 7))])
register_examples("aten.repeat_interleave.self_int", [(T(8, 6), 2, 0), (T(4, 3, 6), 3, 1), (I(8), 2, 0)])
register_examples("aten.topk.default", [(T(32, 3), 2), (T(4, 8, 6), 3, 1), ex(T(4, 6), 2, largest=False)])
register_examples("aten.sort.default", [(T(4, 8),), (I(64),), (T(6, 4), 0, True)])
register_examples("aten.sort.stable", [ex(T(4, 8), stable=True, dim=0)])
