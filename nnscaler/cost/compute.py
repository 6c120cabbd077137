"""Compute time per operator from its annotation: the FLOPs of its bound identifiers on one rank.

An operator that contracts identifiers (ones its outputs lack, like ``k`` in ``m k+, k+ n -> m n``)
does ``2 * prod(local lengths of every identifier)`` FLOPs; one that does not (elementwise, views,
norms) is bound by memory: the bytes of its local inputs and outputs over the memory bandwidth.
Attention (scores and values are two contractions) is counted from its local shapes; lookups
(embedding, gather) only move the rows they read; a fused recurrent layer (``nn.LSTM``/``GRU``/``RNN``)
multiplies each token by its weight matrices (its annotation freezes every weight dim apart, so the
product of all its identifiers would count every weight times every other). Backward costs twice forward.
"""
from __future__ import annotations

import math

from ..dimops.partition import Partition, local_sizes
from ..ir.graph import IROp, IRTensor
from ..profiles import DeviceProfile

BACKWARD = 2.0  # backward FLOPs as a multiple of forward (two matmuls per matmul)
_SDPA = "aten.scaled_dot_product_attention.default"
_LOOKUPS = ("aten.embedding.default", "aten.index_select.default", "aten.gather.default")
_RECURRENT = ("aten.rnn_tanh.input", "aten.rnn_relu.input", "aten.gru.input", "aten.lstm.input")


def _dtype(op: IROp) -> str:
    for t in op.outputs + op.tensor_inputs():
        if t is not None and t.dtype.is_floating_point:
            return str(t.dtype).removeprefix("torch.")
    return "float32"


def _local_shapes(op: IROp, sizes: dict[str, int]) -> list[tuple[IRTensor, tuple[int, ...]]]:
    out = []
    for x, dims in list(zip(op.inputs, op.bound.inputs)) + list(zip(op.outputs, op.bound.outputs)):
        if isinstance(x, IRTensor) and dims is not None:
            out.append((x, op.bound.shape(dims, sizes)))
    return out


def op_flops(op: IROp, partition: Partition | None) -> tuple[float, float]:
    """(FLOPs, bytes touched) of one forward call of ``op`` on one rank under ``partition``."""
    if not op.known:
        nbytes = sum(math.prod(t.shape) * t.dtype.itemsize for t in op.outputs + op.tensor_inputs() if t is not None)
        return 0.0, float(nbytes)
    sizes = local_sizes(op.bound, partition) if partition is not None else dict(op.bound.sizes)
    shapes = _local_shapes(op, sizes)
    nbytes = float(sum(math.prod(s) * t.dtype.itemsize for t, s in shapes))
    if op.overload in _LOOKUPS:  # a gather of rows: reads and writes the output's bytes, no multiply-adds
        out = sum(math.prod(s) * t.dtype.itemsize for t, s in shapes[-len(op.outputs):])
        return 0.0, 2.0 * out
    if op.overload in _RECURRENT and shapes:  # x, states, weights: 2 FLOPs per token per weight (matrices only)
        ins = [op.bound.shape(d, sizes) for x, d in zip(op.inputs, op.bound.inputs) if isinstance(x, IRTensor) and d]
        tokens = math.prod(ins[0][:-1])
        return 2.0 * tokens * sum(math.prod(s) for s in ins[1:] if len(s) == 2), nbytes
    if op.overload == _SDPA and len(shapes) >= 3:
        (_, q), (_, k), (_, v) = shapes[:3]
        heads = math.prod(q[:-2])
        return 2.0 * heads * q[-2] * k[-2] * (q[-1] + v[-1]), nbytes
    out_ids = {i for dims in op.bound.outputs if dims for ids in dims for i in ids}
    in_ids = {i for dims in op.bound.inputs if dims for ids in dims for i in ids}
    contracted = {i for i in in_ids - out_ids if not i.isdigit()}
    if not contracted:
        return 0.0, nbytes
    work = math.prod(sizes[i] for i in (in_ids | out_ids) if i in sizes)
    return 2.0 * work, nbytes


def op_time(op: IROp, partition: Partition | None, profile: DeviceProfile, ranks_here: int) -> float:
    """Seconds for forward plus backward of ``op`` on one rank (roofline: FLOPs or bytes, whichever
    is slower, plus the launch overhead)."""
    flops, nbytes = op_flops(op, partition)
    share = profile.share(ranks_here)
    fwd = max(flops / profile.throughput(_dtype(op), ranks_here), nbytes / (profile.mem_bw * share)) + profile.op_overhead
    return fwd * (1 + BACKWARD)


OPTIMIZER_TRAFFIC = 7  # AdamW reads param, grad, two states and writes param and two states: bytes per param byte


def optimizer_time(param_bytes: float, profile: DeviceProfile, ranks_here: int) -> float:
    """Seconds of one AdamW step over ``param_bytes`` of parameters on one rank (memory bound)."""
    return OPTIMIZER_TRAFFIC * param_bytes / (profile.mem_bw * profile.share(ranks_here))
