"""Verified example calls of the linalg rules (:mod:`opzoo.linalg.rules`), each registered as a zoo entry
``rule.<op>.<i>`` by :func:`opzoo.rulekit.register_examples`: ``linear`` and ``matmul`` at any batch rank,
einsum equations (contractions, broadcasting).

The harness samples its own lengths from the derived annotations.
"""
from __future__ import annotations

from ..rulekit import T, register_examples

register_examples("aten.linear.default", [(T(2, 8, 32), T(96, 32), T(96)), (T(16, 32), T(32, 32)),
                                          (T(32), T(8, 32), T(8)), (T(2, 3, 4, 32), T(8, 32))])
register_examples("aten.matmul.default", [
    (T(2, 4, 8, 8), T(2, 4, 8, 8)), (T(2, 4, 8, 6), T(6, 5)), (T(8), T(8)), (T(4, 8), T(8)),
    (T(8), T(2, 8, 5)), (T(2, 1, 8, 6), T(3, 6, 5))])
register_examples("aten.einsum.default", [  # funnel's attention, a sum, an outer product, ..., broadcasting
    ("bind,bjnd->bnij", [T(2, 8, 4, 6), T(2, 8, 4, 6)]), ("bnij,bjnd->bind", [T(2, 4, 8, 8), T(2, 8, 4, 6)]),
    ("binh,dnh->bind", [T(2, 8, 4, 6), T(5, 4, 6)]), ("ij->i", [T(8, 6)]), ("i,j", [T(8), T(6)]),
    ("...ij,...jk->...ik", [T(2, 4, 8, 6), T(4, 6, 5)]), ("bij,xjk->bik", [T(2, 8, 6), T(1, 6, 5)]),
    ("ab,bc,cd->ad", [T(4, 6), T(6, 8), T(8, 2)])])
