"""Rules for the fused recurrent layers as ``nn.RNN``/``nn.GRU``/``nn.LSTM`` trace them
(``aten.rnn_tanh``/``rnn_relu``/``gru``/``lstm``, ``.input`` overloads: padded batches).

``b s^ i^, L^ b h^, w1^ ..., ? .. -> b s^ o^, L^ b h^`` (``batch_first``; else ``s^ b i^``): the batch
is spatial, everything else frozen. The recurrence runs along the sequence (a split would need the
previous shard's last state), and each step multiplies the whole hidden state by the recurrent
weights, so splitting the hidden size or the gates would need a collective per time step inside the
fused kernel; data parallelism is what a fused layer admits. The states (``hx``, a list of two for
``lstm``) and the weights (a list) are flattened in place, one input per tensor (see
:class:`opzoo.rulekit.Regroup`). Calls with dropout between layers in training are not annotated (the
mask's random stream would follow the shard).
"""
from __future__ import annotations

from nnscaler.ops import OpCall, TensorMeta, annotation_rule

from ..rulekit import Names, build, frozen_dim, usable

FAMILY = "nn"


@annotation_rule("aten.rnn_tanh.input", "aten.rnn_relu.input", "aten.gru.input", "aten.lstm.input")
def rnn_rule(call: OpCall):
    """Batch spatial, sequence, features, layers, states and weights frozen (module docstring)."""
    if not usable(call) or len(call.args) < 9:
        return None
    x, hx, params = call.args[0], call.args[1], call.args[2]
    num_layers, dropout, train, batch_first = call.args[4], call.args[5], call.args[6], call.args[8]
    states = list(hx) if isinstance(hx, (list, tuple)) else [hx]
    if not isinstance(x, TensorMeta) or not all(isinstance(t, TensorMeta) for t in states + list(params)) or \
            (dropout and train and num_layers > 1):
        return None
    names, sizes = Names(), {}
    if x.ndim == 3:
        b = names.dim(x.shape[0 if batch_first else 1], "b")
        bpos = 0 if batch_first else 1
    elif x.ndim == 2:  # unbatched
        b, bpos = None, None
    else:
        return None

    def dims(shape, batch_at):
        return [b if d == batch_at else frozen_dim(names, n, sizes) for d, n in enumerate(shape)]

    if any(t.ndim != (3 if b is not None else 2) for t in states):
        return None
    state_dims = [dims(t.shape, 1 if b is not None else None) for t in states]
    ins = {0: dims(x.shape, bpos), 1: state_dims if isinstance(hx, (list, tuple)) else state_dims[0],
           2: [dims(p.shape, None) for p in params]}
    outs = [dims(m.shape, bpos if k == 0 else (1 if b is not None else None)) for k, m in enumerate(call.outputs)]
    return build(call, FAMILY, ins, outs, sizes=sizes)
