"""Buffer writes a plan cannot keep equal to one device, refused before any process group: a buffer
forward writes from the batch (an EMA of activations, running statistics) under data-parallel
replicas, each of which sees its own share of the batch and nothing of the others'."""
from __future__ import annotations

from ..config import ComputeConfig, PlanError
from ..ir.graph import IRGraph, IRTensor


def from_batch(graph: IRGraph) -> set[IRTensor]:
    """Tensors computed from the model's inputs (the batch)."""
    out = set(graph.inputs)
    for op in graph.ops:
        if any(t in out for t in op.tensor_inputs()):
            out.update(t for t in op.outputs if t is not None)
    return out


def check_writes(graph: IRGraph, config: ComputeConfig) -> None:
    """Raise :class:`PlanError` naming the first buffer forward writes from the batch when
    ``config.replicas`` > 1 (the plan's own ranks reduce such a value over the batch; replicas cannot)."""
    if config.replicas <= 1 or not graph.writes:
        return
    batch = from_batch(graph)
    for w in graph.writes:
        if w.value in batch:
            raise PlanError(f"buffer {w.buffer.target} is written in forward from the batch"
                            + (f" ({w.source})" if w.source else "")
                            + f": {config.replicas} data-parallel replicas would each write it from their own "
                            f"share; plan on all {config.plan_ngpus * config.replicas} ranks (dp) instead of replicas")
