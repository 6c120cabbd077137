"""Run one annotated operator under a partition on this rank: the per-rank program of a single op.

Full inputs are moved to the op's input layouts, the op runs on the local shards, and its outputs are
moved back to whole tensors, all with the differentiable collectives of
:mod:`nnscaler.runtime.collectives`, so backward through the result is the partitioned backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from ..dimops.binding import BoundAnno
from ..dimops.layout import Layout, Partial, Replicate, Shard
from ..dimops.partition import Partition, local_sizes, op_layout
from ..ops.spec import OpSpec, outputs_of, resolve
from . import collectives as C
from .mesh import RankMesh


class LayoutError(RuntimeError):
    """A local result whose shape disagrees with what the annotation says it must be."""


@dataclass(frozen=True)
class ShardContext:
    """What a partition-aware kernel needs to know about its shard of the operator: plain data, so
    generated programs can write one down (``ShardContext({'v': 64}, {'v': 2}, {'v': 1}, {'v': g[0]})``)."""

    sizes: Mapping[str, int]  # full length of every identifier
    factors: Mapping[str, int] = field(default_factory=dict)  # split identifiers only
    indices: Mapping[str, int] = field(default_factory=dict)  # this rank's chunk along each
    groups: Mapping[str, Any] = field(default_factory=dict)  # the process group along each
    balanced: tuple[str, ...] = ()  # split identifiers held in context parallelism's balanced order

    @classmethod
    def of(cls, bound: BoundAnno, partition: Partition, mesh: RankMesh) -> "ShardContext":
        factors, indices, groups = {}, {}, {}
        for axis, ident in enumerate(partition.axis_ids):
            if ident is not None:
                factors[ident] = partition.mesh_shape[axis]
                indices[ident] = mesh.coords[axis]
                groups[ident] = mesh.groups[axis]
        return cls(dict(bound.sizes), factors, indices, groups, tuple(partition.balanced))

    def factor(self, ident: str) -> int:
        return self.factors.get(ident, 1)

    def full(self, ident: str) -> int:
        return self.sizes[ident]

    def local(self, ident: str) -> int:
        return self.sizes[ident] // self.factor(ident)

    def index(self, ident: str) -> int:
        """This rank's chunk index along ``ident`` (0 when it is not split)."""
        return self.indices.get(ident, 0)

    def offset(self, ident: str) -> int:
        """Where this rank's chunk of ``ident`` starts."""
        return self.index(ident) * self.local(ident)

    def group(self, ident: str):
        """The process group of the ranks sharing every coordinate but ``ident``'s (``None`` if unsplit)."""
        return self.groups.get(ident)


def distribute(full: torch.Tensor, layout: Layout, mesh: RankMesh, axis_ids: Sequence[str | None]) -> torch.Tensor:
    """Whole tensor (replicated) -> this rank's piece under ``layout``, differentiably."""
    x = full
    for axis, (placement, ident) in enumerate(zip(layout, axis_ids)):
        group = mesh.groups[axis]
        if isinstance(placement, Shard):
            x = C.split(x, placement.dim, group, placement.blocks)
        elif isinstance(placement, Partial):
            x = C.to_partial(x, group)
        elif ident is not None:  # replicated, but consumed by work split along this axis
            x = C.grad_all_reduce(x, group)
    return x


def collect(local: torch.Tensor, layout: Layout, mesh: RankMesh) -> torch.Tensor:
    """This rank's piece under ``layout`` -> the whole tensor on every rank, differentiably."""
    x = local
    for axis in reversed(range(len(layout))):
        placement, group = layout[axis], mesh.groups[axis]
        if isinstance(placement, Shard):
            x = C.all_gather(x, placement.dim, group, placement.blocks)
        elif isinstance(placement, Partial):
            x = C.all_reduce(x, group)
        else:
            assert isinstance(placement, Replicate)
    return x


def partial_magnitude(local: torch.Tensor, layout: Layout, mesh: RankMesh) -> float | None:
    """``sum over the summed ranks of max|partial|`` of ``local`` before its value-split sum (``None``
    where ``layout`` holds no partial): a correct reduction rounds each partial and each addition in
    the output's dtype, so its error is bounded by eps times this, which may be far larger than the
    sum the partials cancel to."""
    if not any(isinstance(p, Partial) for p in layout) or not local.is_floating_point():
        return None
    m = local.detach().abs().amax().to(torch.float64) if local.numel() else torch.zeros((), dtype=torch.float64)
    for axis, placement in enumerate(layout):
        if isinstance(placement, Partial) and mesh.groups[axis] is not None:
            torch.distributed.all_reduce(m, group=mesh.groups[axis])
    return float(m)


def as_tuple(out: Any) -> tuple:
    """An operator's result as a tuple of outputs."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def run_partitioned(spec: OpSpec, bound: BoundAnno, partition: Partition, mesh: RankMesh,
                    inputs: Sequence[Any], scales: list | None = None) -> tuple[torch.Tensor, ...]:
    """Run ``spec`` under ``partition`` on this rank; return its whole outputs.

    ``inputs`` are the whole inputs (``?`` positions are taken from ``spec.args``, resolved to the
    rank's local lengths). ``scales``, when given, receives each output's :func:`partial_magnitude`.
    """
    sizes = local_sizes(bound, partition)
    floating = [isinstance(x, torch.Tensor) and x.is_floating_point() for x in inputs]
    layout = op_layout(bound, partition, floating)
    local_in = []
    for pos, (x, lay) in enumerate(zip(inputs, layout.inputs)):
        if lay is None:
            local_in.append(resolve(spec.args[pos], sizes) if pos in spec.args else x)
        else:
            local_in.append(distribute(x, lay, mesh, partition.axis_ids))
    kwargs = resolve(dict(spec.kwargs), sizes)
    if spec.local is not None:
        outs = outputs_of(spec.anno, spec.local(ShardContext.of(bound, partition, mesh), *local_in, **kwargs))
    else:
        outs = outputs_of(spec.anno, spec.fn(*local_in, **kwargs))
    if len(outs) != len(layout.outputs):
        raise LayoutError(f"{spec.name} returned {len(outs)} outputs; its annotation names {len(layout.outputs)}")
    full = []
    for pos, (y, lay, dims) in enumerate(zip(outs, layout.outputs, bound.outputs)):
        if scales is not None:
            scales.append(None if lay is None or not isinstance(y, torch.Tensor) else partial_magnitude(y, lay, mesh))
        if lay is None:
            full.append(y)
            continue
        want = bound.shape(dims, sizes)
        if tuple(y.shape) != want and not (want == (1,) and y.dim() == 0):
            raise LayoutError(f"{spec.name} under {partition.label}: output {pos} has local shape {tuple(y.shape)}, "
                              f"the annotation {spec.annotation!r} says {want}")
        full.append(collect(y, lay, mesh))
    return tuple(full)
