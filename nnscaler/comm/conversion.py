"""From a producer's layout of a tensor to a consumer's: the cheapest sequence of collectives.

Layouts are placements per axis of the plan's rank mesh (``D``/``R``/``V``). Each axis converts on
its own (every collective runs within that axis's group), by a shortest-path search over the
placements of one axis whose edges are the differentiable collectives of
:mod:`nnscaler.runtime.collectives`, weighted by the bytes they move (forward, plus backward for
tensors that carry gradients) as a fraction of the tensor's size.

A consumer that is split along an axis but wants the tensor replicated there ("R*") produces only a
partial gradient for it: the conversion ends with ``grad_all_reduce`` (identity forward, all-reduce
backward), or, when it gathers a split tensor last, with ``all_gather_sum_grad`` (all-gather
forward, reduce-scatter backward).
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
    #            | all_gather_sum_grad (all_gather whose backward reduce-scatters partial gradients)
    dims: tuple[int, ...] = ()
    blocks: int = 1  # split / all_gather / reduce_scatter of one factor of a fused dim

    def code(self, x: str, group: str) -> str:
        """The Python expression the generated program uses for this step."""
        args = ", ".join([x, *map(str, self.dims), group] + ([f"blocks={self.blocks}"] if self.blocks > 1 else []))
        return f"C.{self.kind}({args})"


def _edges(p: Placement, ndim: int, f: int, grad: bool, a2a: bool, dst: Placement):
    """(next placement, step kind, dims, blocks, cost) from placement ``p`` on an axis of ``f``
    ranks. Shards in blocks are reached only when they are the destination ``dst``, and left only
    by an all-gather."""
    frac = (f - 1) / f
    back = 1.0 if grad else 0.0
    shards = [Shard(d) for d in range(ndim)]
    if isinstance(dst, Shard) and dst.blocks > 1:
        shards.append(dst)
    if isinstance(p, Replicate):
        for q in shards:
            yield q, "split", (q.dim,), q.blocks, back * frac  # backward all-gathers the gradient
        yield Partial(), "to_partial", (), 1, 0.0
    elif isinstance(p, Shard):
        yield Replicate(), "all_gather", (p.dim,), p.blocks, frac
        for d in range(ndim if a2a and p.blocks == 1 else 0):
            if d != p.dim:
                yield Shard(d), "all_to_all", (p.dim, d), 1, (1 + back) * frac / f
    elif isinstance(p, Partial):
        yield Replicate(), "all_reduce", (), 1, 2 * frac
        for q in shards:
            yield q, "reduce_scatter", (q.dim,), q.blocks, (1 + back) * frac


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
        for q, kind, dims, blocks, c in _edges(p, ndim, f, grad, a2a, dst):
            if cost + c < best.get(q, float("inf")):
                best[q] = cost + c
                heapq.heappush(queue, (cost + c, tie, q, path + [Step(axis, kind, dims, blocks)]))
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
        total += c
        if isinstance(dst[axis], Replicate) and dst_axis_ids[axis] is not None and grad:
            frac = (mesh_shape[axis] - 1) / mesh_shape[axis]
            if s and s[-1].kind == "all_gather":  # gathered for split work: reduce-scatter its gradient
                s[-1] = Step(axis, "all_gather_sum_grad", s[-1].dims, s[-1].blocks)
                total += frac
            else:
                s.append(Step(axis, "grad_all_reduce"))
                total += 2 * frac
        steps += s
    return steps, total
