"""Buffers forward writes from the batch, under data-parallel replicas (``runtime_ngpus`` above
``plan_ngpus``): each replica is fed its own share of the batch, so a statistic of it (an EMA of
activations, batch norm's running statistics) would differ between replicas and from one device.

They are written as SyncBatchNorm writes its statistics: every operator that mixes the batch's rows on
the way to a written value (a mean, a variance, a maximum, batch norm itself) runs on every replica's
rows, gathered over the replicas' group along the batch dim, and keeps its own rows of any output
that has them (:mod:`nnscaler.runtime.replica_rows`). Each replica then writes what one device writes.
Where the batch's rows cannot be followed to a write, the write is refused before any process group,
naming the buffer and the model's line."""
from __future__ import annotations

import dataclasses

from ..config import ComputeConfig, PlanError
from ..ir.graph import BufferWrite, IRGraph, IROp, IRTensor
from ..ir.plan import Plan
from ..policies.builtin import batch_rows


def from_batch(graph: IRGraph) -> set[IRTensor]:
    """Tensors computed from the model's inputs (the batch)."""
    out = set(graph.inputs)
    for op in graph.ops:
        if any(t in out for t in op.tensor_inputs()):
            out.update(t for t in op.outputs if t is not None)
    return out


def _refuse(w: BufferWrite, config: ComputeConfig, why: str) -> PlanError:
    return PlanError(f"buffer {w.buffer.target} is written in forward from the batch"
                     + (f" ({w.source})" if w.source else "")
                     + f": {config.replicas} data-parallel replicas each hold their own share of it, and {why}; "
                     f"plan on all {config.plan_ngpus * config.replicas} ranks (dp) instead of replicas")


def check_writes(graph: IRGraph, config: ComputeConfig) -> None:
    """Raise :class:`PlanError` naming the first buffer forward writes from the batch when
    ``config.replicas`` > 1 on pipeline stages (whose schedule runs no collective across replicas)."""
    if config.replicas <= 1:
        return
    batch = from_batch(graph)
    for w in graph.writes:
        if w.value in batch:
            raise _refuse(w, config, "pipeline stages do not gather the batch's rows across replicas")


def _row_dim(dims, ident: str) -> int | None:
    """The dim made of ``ident`` alone, if any."""
    return next((d for d, ids in enumerate(dims or ()) if ids == (ident,)), None)


def mixes_rows(op: IROp, ident: str) -> bool:
    """Whether ``op`` combines the batch's rows (``ident``): it reduces over them or keeps them whole
    (``+``/``^``), couples statistics over them (batch norm), or has an output without them."""
    if op.bound.markers.get(ident, "") or ident in op.spec.coupled:
        return True
    return any(t is not None and dims is not None and not any(ident in ids for ids in dims)
               for t, dims in zip(op.outputs, op.bound.outputs))


def ops_over_replicas(graph: IRGraph, config: ComputeConfig) -> dict[str, str]:
    """The operators to run on every replica's rows (name -> the batch's identifier there) so that each
    buffer forward writes from the batch holds the single-device value; empty without replicas or such
    writes. Raises :class:`PlanError` naming the buffer and line where the rows cannot be followed."""
    if config.replicas <= 1 or not graph.writes:
        return {}
    batch = from_batch(graph)
    writes = [w for w in graph.writes if w.value in batch]
    if not writes:
        return {}
    if config.num_microbatches > 1:
        raise _refuse(writes[0], config, f"{config.num_microbatches} micro-batches of each share would write it once per "
                      "micro-batch of every replica's rows, not as one device writes it")
    idents, rows = batch_rows(graph)
    out: dict[str, str] = {}
    for w in writes:
        cone: set[str] = set()
        stack = [w.value]
        while stack:  # the operators between the batch and the written value
            t = stack.pop()
            if t in batch and t.producer is not None and t.producer.name not in cone:
                cone.add(t.producer.name)
                stack.extend(t.producer.tensor_inputs())
        whole: set[IRTensor] = set()  # equal on every replica once the mixing operators run over them all
        for op in graph.ops:
            if op.name not in cone:
                continue
            ins = [t for t in op.tensor_inputs() if t in batch]
            outs = [t for t in op.outputs if t is not None]
            if all(t in whole for t in ins):
                whole.update(outs)
                continue
            ident = idents.get(op.name)
            if ident is None or any(t not in whole and t not in rows for t in ins):
                raise _refuse(w, config, f"its rows cannot be followed through {op.name} ({op.overload})")
            if not mixes_rows(op, ident):
                continue  # row by row: each replica computes its own rows
            for t, dims in [*zip(op.inputs, op.bound.inputs), *zip(op.outputs, op.bound.outputs)]:
                if isinstance(t, IRTensor) and (t in rows or t in outs) and any(ident in ids for ids in dims or ()) \
                        and (_row_dim(dims, ident) is None or rows.get(t, (0, 1))[1] != 1):
                    raise _refuse(w, config, f"{op.name} ({op.overload}) mixes its rows with another dim")
            out[op.name] = ident
            whole.update(t for t, dims in zip(op.outputs, op.bound.outputs)
                         if t is not None and _row_dim(dims, ident) is None)
        if w.value not in whole:
            raise _refuse(w, config, "the value written holds rows of the batch (each replica would keep its own)")
    return out


def over_replicas(plan: Plan, graph: IRGraph, ops: dict[str, str], replicas: int) -> Plan:
    """``plan`` with ``ops`` run on every replica's rows: each keeps its batch identifier whole on the
    plan's own ranks (the replicas' rows are gathered on top of them)."""
    if not ops:
        return plan
    parts = dict(plan.partitions)
    for op in graph.ops:
        ident = ops.get(op.name)
        if ident is None or op.name not in parts:
            continue
        p = parts[op.name]
        parts[op.name] = dataclasses.replace(
            p, splits=tuple((None if i == ident else i, f) for i, f in p.splits),
            blocks=tuple(b for b in p.blocks if b[0] != ident), balanced=tuple(b for b in p.balanced if b != ident))
    return dataclasses.replace(plan, partitions=parts, over_replicas=dict(ops), replicas=replicas)
