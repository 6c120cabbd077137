"""Verified example calls of the loss rules (:mod:`opzoo.loss.rules`), each registered as a zoo entry
``rule.<op>.<i>`` by :func:`opzoo.rulekit.register_examples`: cross entropy and NLL (every reduction,
ignore_index), MSE.

The harness samples its own lengths from the derived annotations.
"""
from __future__ import annotations

from ..rulekit import I, T, register_examples

register_examples("aten.cross_entropy_loss.default", [
    (T(16, 64), I(16), None, 1, -1), (T(16, 64), I(16)), (T(16, 64), I(16), None, 0),
    (T(16, 64), I(16), None, 2, -100)])
register_examples("aten.nll_loss_nd.default", [(T(16, 10), I(16), None, 1, -100), (T(16, 10), I(16), None, 0)])
register_examples("aten.mse_loss.default", [(T(4, 8, 6), T(4, 8, 6)), (T(4, 8), T(4, 8), 2), (T(4, 6), T(4, 6), 0)])
