"""From a producer's layout of a tensor to a consumer's: the cheapest sequence of collectives.

Layouts are placements per axis of the plan's rank mesh (``D``/``R``/``V``). Each axis converts on
its own (every collective runs within that axis's group), by a shortest-path search over the
placements of one axis whose edges are the differentiable collectives of
:mod:`nnscaler.runtime.collectives`, weighted by the bytes they move (forward, plus backward for
tensors that carry gradients) as a fraction of the tensor's size.

A consumer that is split along an axis but wants the tensor replicated there ("R*") produces only a
partial gradient for it: the conversion ends with ``grad_all_reduce`` (identity forward, all-reduce
backward).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from ..dimops.layout import Layout, Partial, Placement, Replicate, Shard


@dataclass(frozen=True)
class Step:
    """One collective on one mesh axis: ``kind`` with its dims (see the runtime collectives)."""

    axis: int
    kind: str  # split | all_gather | all_reduce | reduce_scatter | all_to_all | to_partial | grad_all_reduce
    dims: tuple[int, ...] = ()

    def code(self, x: str, group: str) -> str:
        """The Python expression the generated program uses for this step."""
        args = ", ".join([x, *map(str, self.dims), group])
        return f"C.{self.kind}({args})"


def step_layout(layout: Layout, step: Step) -> Layout:
    """The layout a tensor has after ``step``."""
    new = {"split": lambda: Shard(step.dims[0]), "all_gather": Replicate, "all_reduce": Replicate,
           "reduce_scatter": lambda: Shard(step.dims[0]), "to_partial": Partial,
           "all_to_all": lambda: Shard(step.dims[-1])}.get(step.kind)
    if new is None:  # grad_all_reduce: identity forward
        return layout
    return tuple(new() if a == step.axis else p for a, p in enumerate(layout))


def _edges(p: Placement, ndim: int, f: int, grad: bool, a2a: bool):
    """(next placement, step kind, dims, cost) from placement ``p`` on an axis of ``f`` ranks."""
    frac = (f - 1) / f
    back = 1.0 if grad else 0.0
    if isinstance(p, Replicate):
        for d in range(ndim):
            yield Shard(d), "split", (d,), back * frac  # backward all-gathers the gradient
        yield Partial(), "to_partial", (), 0.0
    elif isinstance(p, Shard):
        yield Replicate(), "all_gather", (p.dim,), frac
        for d in range(ndim if a2a else 0):
            if d != p.dim:
                yield Shard(d), "all_to_all", (p.dim, d), (1 + back) * frac / f
    elif isinstance(p, Partial):
        yield Replicate(), "all_reduce", (), 2 * frac
        for d in range(ndim):
            yield Shard(d), "reduce_scatter", (d,), (1 + back) * frac


def axis_steps(src: Placement, dst: Placement, axis: int, ndim: int, f: int, grad: bool,
               a2a: bool = True) -> tuple[list[Step], float]:
    """Cheapest steps turning ``src`` into ``dst`` on one axis, and their cost."""
    if src == dst:
        return [], 0.0
    best = {src: 0.0}
    queue: list = [(0.0, 0, src, [])]
    tie = 1
    while queue:
        cost, _, p, path = heapq.heappop(queue)
        if p == dst:
            return path, cost
        if cost > best.get(p, float("inf")):
            continue
        for q, kind, dims, c in _edges(p, ndim, f, grad, a2a):
            if cost + c < best.get(q, float("inf")):
                best[q] = cost + c
                heapq.heappush(queue, (cost + c, tie, q, path + [Step(axis, kind, dims)]))
                tie += 1
    raise ValueError(f"no conversion from {src} to {dst}")


def conversion(src: Layout, dst: Layout, dst_axis_ids: Sequence[str | None], mesh_shape: Sequence[int],
               ndim: int, grad: bool) -> tuple[list[Step], float]:
    """Steps (and their cost) from ``src`` to the layout a consumer wants, ``dst``, where
    ``dst_axis_ids`` are the identifiers the consumer splits along each axis (``None``: replicated)."""
    steps: list[Step] = []
    total = 0.0
    # gathers and reductions first, splits last: a tensor is never split twice along one dim
    order = sorted(range(len(mesh_shape)), key=lambda a: isinstance(dst[a], Shard))
    # all-to-all re-chunks one dim while keeping others: only safe when no other axis shards
    a2a = sum(isinstance(p, Shard) for p in list(src) + list(dst)) <= 2
    for axis in order:
        s, c = axis_steps(src[axis], dst[axis], axis, ndim, mesh_shape[axis], grad, a2a)
        steps += s
        total += c
        if isinstance(dst[axis], Replicate) and dst_axis_ids[axis] is not None and grad:
            steps.append(Step(axis, "grad_all_reduce"))
            total += 2 * (mesh_shape[axis] - 1) / mesh_shape[axis]
    return steps, total
