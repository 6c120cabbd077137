"""The collectives one layout-conversion step issues in forward and backward, with their time."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..dimops.layout import Layout, Shard
from ..ir.graph import ACTIVATION, PARAM, IRTensor
from ..runtime.grad_sync import BUCKET_BYTES
from .comm import runtime_time, spans_nodes
from ..profiles import DeviceProfile

OPTIMIZER_STATES = 2  # AdamW keeps exp_avg and exp_avg_sq, each the size of the parameter
# a step's forward collective, and the one its backward issues (for tensors that carry gradients)
_FORWARD = {"all_gather": "all_gather", "all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter",
            "all_to_all": "all_to_all", "all_gather_sum_grad": "all_gather"}
_BACKWARD = {"split": "all_gather", "reduce_scatter": "all_gather", "grad_all_reduce": "all_reduce",
             "all_to_all": "all_to_all", "all_gather_sum_grad": "reduce_scatter"}


@dataclass(frozen=True)
class Collective:
    """One collective a rank issues per step: ``phase`` forward, backward or grad sync."""

    phase: str
    kind: str
    axis: str
    ranks: int
    nbytes: int
    seconds: float
    tensor: str = ""
    coupled: bool = False  # issued inside an operator's own kernel (OpSpec.coupled), not by a conversion


def nbytes(t: IRTensor) -> int:
    return math.prod(t.shape) * t.dtype.itemsize


def local_nbytes(t: IRTensor, layout: Layout, mesh_shape) -> int:
    split = math.prod(f for f, q in zip(mesh_shape, layout) if isinstance(q, Shard))
    return nbytes(t) // split


def carries_grad(t: IRTensor) -> bool:
    return t.dtype.is_floating_point and t.kind in (PARAM, ACTIVATION)


def step_collectives(t: IRTensor, before: Layout, step, mesh_shape, axis_names, profile: DeviceProfile,
                     bucketed: bool = False) -> list[Collective]:
    """The forward and backward collectives one conversion step of ``t`` (in layout ``before``) issues;
    ``bucketed``: a parameter's gradient sum rides in a shared bucket (it pays its share of latency)."""
    f = mesh_shape[step.axis]
    size = local_nbytes(t, before, mesh_shape) * (f if step.kind in ("all_gather", "all_gather_sum_grad") else 1)
    across = spans_nodes(mesh_shape, step.axis, profile)
    out = []
    share = min(1.0, size / BUCKET_BYTES) if bucketed and step.kind == "grad_all_reduce" else 1.0
    for phase, table in (("forward", _FORWARD), ("backward", _BACKWARD)):
        kind = table.get(step.kind)
        if kind is None or (phase == "backward" and not carries_grad(t)):
            continue
        out.append(Collective(phase, kind, axis_names[step.axis], f, size,
                              runtime_time(kind, size, f, profile, across, share), t.name))
    return out


def coalesced_into(lead: Collective, extra: Collective, mesh_shape, axis: int, profile: DeviceProfile) -> Collective:
    """``lead`` carrying ``extra``'s bytes too: one call for both (``nnscaler/codegen/coalesce.py``)."""
    size = lead.nbytes + extra.nbytes
    return replace(lead, nbytes=size, seconds=runtime_time(lead.kind, size, lead.ranks, profile,
                                                           spans_nodes(mesh_shape, axis, profile)))


def coupled_splits(graph, plan):
    """``(operator, mesh axis, identifier)`` wherever ``plan`` splits an identifier the operator's spec
    declares ``coupled`` (:attr:`nnscaler.ops.spec.OpSpec.coupled`)."""
    for op in graph.ops:
        coupled = getattr(op.spec, "coupled", ()) if op.known else ()
        for axis, ident in enumerate(plan.partition(op).axis_ids if coupled else ()):
            if ident in coupled:
                yield op, axis, ident


def coupled_collectives(graph, plan, profile: DeviceProfile) -> list[Collective]:
    """The collectives operators issue inside their own kernels where ``plan`` splits an identifier
    their spec declares ``coupled`` (batch norm over a split batch gathers every rank's statistics in
    one collective, its backward one reduce-scatter): per such operator and mesh axis, a forward
    all-gather and a backward reduce-scatter of the operator's outputs that identifier does not index
    (the statistics; for batch norm with its running pair too: an upper bound of a small payload)."""
    out = []
    mesh, names = plan.mesh_shape, plan.axis_names
    for op, axis, ident in coupled_splits(graph, plan):
        part = plan.partition(op)
        f = part.factor(ident)
        size = f * sum(nbytes(t) // math.prod(part.factor(ids[0]) for ids in dims if ids)
                       for t, dims in zip(op.outputs, op.bound.outputs)
                       if t is not None and dims is not None and not any(ident in ids for ids in dims))
        across = axis < len(mesh) and spans_nodes(mesh, axis, profile)
        for phase, kind in (("forward", "all_gather"), ("backward", "reduce_scatter")):
            out.append(Collective(phase, kind, names[axis] if axis < len(names) else "?", f, size,
                                  runtime_time(kind, size, f, profile, across), op.name, coupled=True))
    return out


def exchange_collectives(graph, plan, profile: DeviceProfile) -> list[Collective]:
    """The sends operators issue inside their own kernels around a ring where ``plan`` splits an identifier their
    spec declares exchanged (:attr:`nnscaler.ops.spec.OpSpec.exchange`: ring attention's keys and values over the
    ranks splitting the sequence): over ``f`` ranks, forward ``f - 1`` steps each sending the rank's piece of those
    inputs to the next rank (one ``batch_isend_irecv``, ``send_recv`` here), backward ``f - 1`` such steps of the
    inputs again and ``f`` of their gradients (the last ending at their owner). Each step is priced as one hop
    (latency plus its bytes over the link), none of it hidden behind the attention it overlaps."""
    out = []
    mesh, names = plan.mesh_shape, plan.axis_names
    for op in graph.ops:
        for ident, positions in (getattr(op.spec, "exchange", ()) if op.known else ()):
            part = plan.partition(op)
            lay = op.layout(part)
            for axis, split in enumerate(part.axis_ids):
                f = part.mesh_shape[axis]
                if split != ident or f < 2:
                    continue
                sent = [x for x in (op.inputs[i] for i in positions) if isinstance(x, IRTensor)]
                size = sum(local_nbytes(x, lay.inputs[i], part.mesh_shape) for i, x in zip(positions, sent))
                alpha, beta = profile.link(axis < len(mesh) and spans_nodes(mesh, axis, profile))
                hop = alpha + size / beta
                axis_name = names[axis] if axis < len(names) else "?"
                steps = [("forward", f - 1), ("backward", f - 1)] + \
                    ([("backward", f)] if any(carries_grad(x) for x in sent) else [])
                for phase, n in steps:
                    out += [Collective(phase, "send_recv", axis_name, f, size, hop, op.name, coupled=True)] * n
    return out
