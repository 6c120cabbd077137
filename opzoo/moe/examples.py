"""Verified example calls of the moe rules (:mod:`opzoo.moe.rules`), each registered as a zoo entry
``rule.<op>.<i>`` by :func:`opzoo.rulekit.register_examples`: the mixture-of-experts bookkeeping: ``histc``
and ``_grouped_mm``.

The harness samples its own lengths from the derived annotations.
"""
from __future__ import annotations

import torch

from ..rulekit import T, register_examples

register_examples("aten.histc.default", [(T(64), 3, 0, 2), (T(4, 8), 5, -1.0, 1.0)])
register_examples("aten._grouped_mm.default", [(T(16, 8), T(3, 8, 12), T(3, dtype=torch.int32)),
                                               (T(12, 4), T(2, 4, 8), T(2, dtype=torch.int32))])
