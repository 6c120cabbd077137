"""Verified example calls of the recurrent rules (:mod:`opzoo.recurrent.rules`), each registered as a zoo entry
``rule.<op>.<i>`` by :func:`opzoo.rulekit.register_examples`: GRU, LSTM and tanh RNN layers (bidirectional,
several layers, no bias).

The harness samples its own lengths from the derived annotations.
"""
from __future__ import annotations

from ..rulekit import T, register_examples


def _rnn_params(gates: int, inp: int, hid: int, layers: int = 1, bidirectional: bool = False, bias: bool = True):
    """The flat weight list of ``nn.RNN/GRU/LSTM`` (per layer and direction: w_ih, w_hh[, b_ih, b_hh])."""
    out, dirs = [], 2 if bidirectional else 1
    for layer in range(layers):
        for _ in range(dirs):
            out += [T(gates * hid, inp if layer == 0 else hid * dirs), T(gates * hid, hid)]
            out += [T(gates * hid), T(gates * hid)] if bias else []
    return out


register_examples("aten.gru.input", [(T(4, 5, 6), T(2, 4, 8), _rnn_params(3, 6, 8, 2), True, 2, 0.0, True, False, True),
                                     (T(5, 4, 6), T(2, 4, 8), _rnn_params(3, 6, 8, 1, True, False), False, 1, 0.0,
                                      True, True, False)])
register_examples("aten.lstm.input", [(T(4, 5, 6), [T(1, 4, 8), T(1, 4, 8)], _rnn_params(4, 6, 8), True, 1, 0.0, True,
                                       False, True)])
register_examples("aten.rnn_tanh.input", [(T(4, 5, 6), T(1, 4, 8), _rnn_params(1, 6, 8), True, 1, 0.0, True, False, True)])
