"""From a producer's layout of a tensor to a consumer's: the cheapest sequence of collectives.

A layout gives one placement per axis of the plan's rank mesh (``D``/``R``/``V``).

**Nesting convention** (DTensor's): when several mesh axes split the same tensor dim, the lower
axis splits first and each higher axis splits the chunk it is given further. Under ``D1xD1`` on a
(2, 2) mesh, rank (i, j) holds quarter ``2*i + j`` of dim 1; under ``D0xD1`` it holds half ``i`` of
dim 0 and half ``j`` of dim 1. :func:`nnscaler.codegen.emit.shard_slices` (where the state lives),
``ParallelModule._whole`` (gathering, highest axis first) and this search all follow it.

**Search.** Conversions are shortest paths over whole-mesh layouts. Each edge is one
differentiable collective of :mod:`nnscaler.runtime.collectives` on one axis, and it is an edge
only where the local shards it produces are the right pieces of the next layout:

* splitting dim ``d`` on axis ``a`` (``split``, ``reduce_scatter``, the split half of
  ``all_to_all``) cuts the rank's local chunk once more, which under the convention is the piece of
  the *innermost* split of ``d``: legal only when no axis above ``a`` splits ``d`` already, and (when
  lengths are known) only when the local length divides evenly;
* gathering dim ``d`` on axis ``a`` (``all_gather``, the gather half of ``all_to_all``)
  concatenates neighbours' chunks, which is a contiguous piece only when ``a`` is the innermost axis
  splitting ``d``: legal only when no axis above ``a`` splits ``d``;
* ``all_reduce`` and ``to_partial`` keep every shard's extent and are always legal;
* a shard in blocks (``D2/3``: one factor of a fused dim, each rank holding its chunk of every block)
  must be the only split of its dim: it is reached only when it is the target's placement on that
  axis (by ``split`` or ``reduce_scatter``, with no other axis splitting the dim), no axis splits
  its dim further, and it is left only by an ``all_gather`` (with ``blocks``);
* a shard in the balanced order of context parallelism (``D1z``) follows the same rules as a shard
  in blocks: reached by ``split``/``reduce_scatter`` of the dim put in that order
  (``to_balanced``), left by ``all_gather`` then ``from_balanced``.

Every forward step then maps correct local pieces to correct local pieces, so its backward (the
transpose collective on the same group) maps the right piece of the whole gradient back to the
right piece: the gradient is right by construction, which is why the search is over whole layouts
rather than per axis ("gather everything, then split" per axis is not enough: ``D0xD1 -> D1xD0``
run axis by axis splits dim 1 on axis 0 while axis 1 still splits it).

Edge weights are the bytes a step moves (forward, plus backward for tensors that carry gradients)
as a fraction of the whole tensor's size, so planners multiply by the element count.

A consumer that is split along an axis but wants the tensor replicated there (``R*``) produces only a
partial gradient for it: the conversion ends with ``grad_all_reduce`` (identity forward, all-reduce
backward), or, when it gathers a split tensor last, with ``all_gather_sum_grad`` (all-gather
forward, reduce-scatter backward).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Iterator, Sequence

from ..dimops.layout import Layout, Partial, Placement, Replicate, Shard


@dataclass(frozen=True)
class Step:
    """One collective on one mesh axis: ``kind`` with its dims (see the runtime collectives)."""

    axis: int
    kind: str  # split | all_gather | all_reduce | reduce_scatter | all_to_all | to_partial | grad_all_reduce
    #            | all_gather_sum_grad (all_gather whose backward reduce-scatters partial gradients)
    dims: tuple[int, ...] = ()
    blocks: int = 1  # split / all_gather / reduce_scatter of one factor of a fused dim
    balanced: bool = False  # ... of a dim held in the balanced order of context parallelism (``D1z``)
    coalesced: bool = False  # an all_reduce riding in an earlier one's collective (nnscaler/codegen/coalesce.py)

    def code(self, x: str, group: str) -> str:
        """The Python expression the generated program uses for this step."""
        extra = [f"blocks={self.blocks}"] if self.blocks > 1 else []
        if self.balanced and self.kind in ("split", "reduce_scatter"):
            x = f"C.to_balanced({', '.join([x, str(self.dims[0]), group] + extra)})"
        args = ", ".join([x, *map(str, self.dims), group] + extra)
        if self.balanced and self.kind in ("all_gather", "all_gather_sum_grad"):
            return f"C.from_balanced(C.{self.kind}({args}), {', '.join([str(self.dims[0]), group] + extra)})"
        return f"C.{self.kind}({args})"


def step_layout(layout: Layout, step: Step) -> Layout:
    """The layout a tensor has after ``step``."""
    new = {"split": lambda: Shard(step.dims[0], step.blocks, step.balanced), "all_gather": Replicate,
           "all_gather_sum_grad": Replicate, "all_reduce": Replicate,
           "reduce_scatter": lambda: Shard(step.dims[0], step.blocks, step.balanced), "to_partial": Partial,
           "all_to_all": lambda: Shard(step.dims[-1])}.get(step.kind)
    if new is None:  # grad_all_reduce: identity forward
        return layout
    return tuple(new() if a == step.axis else p for a, p in enumerate(layout))


def local_fraction(layout: Layout, mesh_shape: Sequence[int]) -> float:
    """The share of the whole tensor's elements one rank holds under ``layout``."""
    return 1.0 / math.prod(f for f, q in zip(mesh_shape, layout) if isinstance(q, Shard))


def _outermost_free(layout: Layout, axis: int, dim: int) -> bool:
    """No axis above ``axis`` splits ``dim``: ``axis`` is (or would be) its innermost split."""
    return not any(isinstance(q, Shard) and q.dim == dim for q in layout[axis + 1:])


def _unsplit(layout: Layout, dim: int) -> bool:
    """No axis splits ``dim`` (a shard in blocks must be its dim's only split)."""
    return not any(isinstance(q, Shard) and q.dim == dim for q in layout)


def _special(q: Placement) -> bool:
    """A shard in blocks or in the balanced order: its dim's only split, reached and left whole."""
    return isinstance(q, Shard) and (q.blocks > 1 or q.balanced)


def _in_blocks(layout: Layout, dim: int) -> bool:
    """Some axis splits ``dim`` in blocks or balanced (then nothing may split it further)."""
    return any(_special(q) and q.dim == dim for q in layout)


def _divides(layout: Layout, axis: int, dim: int, mesh_shape: Sequence[int], shape: Sequence[int] | None,
             blocks: int = 1) -> bool:
    """Whether the rank's local length of ``dim`` splits evenly into ``mesh_shape[axis]`` chunks
    (of each of ``blocks`` blocks)."""
    if shape is None:
        return True
    held = math.prod(f for f, q in zip(mesh_shape, layout) if isinstance(q, Shard) and q.dim == dim)
    return shape[dim] % (held * mesh_shape[axis] * blocks) == 0


def _edges(lay: Layout, dst: Layout, mesh_shape: Sequence[int], ndim: int, shape,
           grad: bool) -> Iterator[tuple[Layout, Step, float]]:
    """(next layout, step, cost) of every legal collective from ``lay`` towards ``dst`` (whose
    shards in blocks are the only ones reachable)."""
    back = 1.0 if grad else 0.0
    s = local_fraction(lay, mesh_shape)
    for a, (f, p) in enumerate(zip(mesh_shape, lay)):
        if f == 1:
            continue
        frac = (f - 1) / f
        want = dst[a]
        blocked = want if _special(want) else None

        def to(q: Placement) -> Layout:
            return lay[:a] + (q,) + lay[a + 1:]

        def can_split(d: int, base: Layout) -> bool:
            return (_outermost_free(base, a, d) and not _in_blocks(base, d)
                    and _divides(base, a, d, mesh_shape, shape))

        def can_split_blocks(base: Layout) -> bool:
            return (blocked is not None and _unsplit(base, blocked.dim)
                    and _divides(base, a, blocked.dim, mesh_shape, shape, blocked.blocks * (2 if blocked.balanced else 1)))

        if isinstance(p, Replicate):
            for d in range(ndim):
                if can_split(d, lay):
                    yield to(Shard(d)), Step(a, "split", (d,)), back * frac * s  # backward gathers
            if can_split_blocks(lay):
                yield to(blocked), Step(a, "split", (blocked.dim,), blocked.blocks, blocked.balanced), back * frac * s
            yield to(Partial()), Step(a, "to_partial"), 0.0
        elif isinstance(p, Shard):
            if not _outermost_free(lay, a, p.dim):
                continue
            gathered = to(Replicate())
            yield gathered, Step(a, "all_gather", (p.dim,), p.blocks, p.balanced), frac * s * f
            for d in range(0 if _special(p) else ndim):  # a shard in blocks (or balanced) is left only by a gather
                if d != p.dim and can_split(d, gathered):
                    yield to(Shard(d)), Step(a, "all_to_all", (p.dim, d)), (1 + back) * frac * s
        else:  # Partial
            yield to(Replicate()), Step(a, "all_reduce"), 2 * frac * s
            for d in range(ndim):
                if can_split(d, lay):
                    yield to(Shard(d)), Step(a, "reduce_scatter", (d,)), (1 + back) * frac * s
            if can_split_blocks(lay):
                yield (to(blocked), Step(a, "reduce_scatter", (blocked.dim,), blocked.blocks, blocked.balanced),
                       (1 + back) * frac * s)


def _check_blocks(layout: Layout, mesh_shape: Sequence[int]) -> None:
    for a, (f, q) in enumerate(zip(mesh_shape, layout)):
        if _special(q) and f > 1 and any(
                isinstance(o, Shard) and o.dim == q.dim and b != a and mesh_shape[b] > 1 for b, o in enumerate(layout)):
            raise ValueError(f"layout {'x'.join(map(str, layout))}: dim {q.dim} is split in blocks on axis {a} "
                             f"and split again on another axis; a split in blocks must be its dim's only split")


@lru_cache(maxsize=65536)
def layout_steps(src: Layout, dst: Layout, mesh_shape: tuple[int, ...], ndim: int,
                 shape: tuple[int, ...] | None, grad: bool) -> tuple[tuple[Step, ...], float]:
    """Cheapest legal steps turning ``src`` into ``dst`` on the whole mesh, and their cost (fewest
    steps, then first found, on a tie)."""
    if len(src) != len(mesh_shape) or len(dst) != len(mesh_shape):
        raise ValueError(f"layouts {src} and {dst} need one placement per axis of mesh {mesh_shape}")
    if src == dst:
        return (), 0.0
    for lay in (src, dst):
        _check_blocks(lay, mesh_shape)
    best = {src: (0.0, 0)}
    queue: list = [(0.0, 0, 0, src, ())]
    tie = 1
    while queue:
        cost, n, _, lay, path = heapq.heappop(queue)
        if lay == dst:
            return path, cost
        if (cost, n) > best.get(lay, (math.inf, 0)):
            continue
        for nxt, step, c in _edges(lay, dst, mesh_shape, ndim, shape, grad):
            key = (cost + c, n + 1)
            if key < best.get(nxt, (math.inf, 0)):
                best[nxt] = key
                heapq.heappush(queue, (cost + c, n + 1, tie, nxt, path + (step,)))
                tie += 1
    raise ValueError(f"no conversion from {'x'.join(map(str, src))} to {'x'.join(map(str, dst))} on mesh "
                     f"{mesh_shape} for a tensor of shape {shape if shape is not None else f'with {ndim} dims'}: "
                     f"a split dim's length is not divisible by the ranks (and blocks) splitting it")


def conversion(src: Layout, dst: Layout, dst_axis_ids: Sequence[str | None], mesh_shape: Sequence[int],
               shape: int | Sequence[int], grad: bool) -> tuple[list[Step], float]:
    """Steps (and their cost, as a fraction of the whole tensor's bytes) from ``src`` to the layout a
    consumer wants, ``dst``, where ``dst_axis_ids`` are the identifiers the consumer splits along each
    axis (``None``: replicated). ``shape`` is the tensor's shape (every intermediate split must then
    divide evenly) or just its number of dims (lengths unknown: no divisibility check).

    On an ``R*`` axis (replicated for work split along it) the gradient coming back is partial: when
    the path's last step on that axis is an ``all_gather``, it becomes ``all_gather_sum_grad``
    (reduce-scatter backward); otherwise a ``grad_all_reduce`` is appended. Either is right because
    the backward of every later step (on other axes) commutes with a sum over this axis's group."""
    mesh_shape = tuple(mesh_shape)
    if isinstance(shape, int):
        ndim, lengths = shape, None
    else:
        lengths = tuple(int(n) for n in shape)
        ndim = len(lengths)
    # on an axis of one rank every placement is the whole tensor: nothing to convert there
    src, dst = (tuple(Replicate() if f == 1 else q for f, q in zip(mesh_shape, lay)) for lay in (src, dst))
    path, total = layout_steps(src, dst, mesh_shape, ndim, lengths, grad)
    steps = list(path)
    after, lay = [], src  # the layout after each step
    for st in steps:
        lay = step_layout(lay, st)
        after.append(lay)
    s = local_fraction(dst, mesh_shape)
    for axis, f in enumerate(mesh_shape):
        if not (isinstance(dst[axis], Replicate) and dst_axis_ids[axis] is not None and grad and f > 1):
            continue
        frac = (f - 1) / f
        last = max((i for i, st in enumerate(path) if st.axis == axis), default=None)
        if last is not None and path[last].kind == "all_gather":  # gathered for split work: reduce-scatter its gradient
            st = path[last]
            steps[last] = replace(st, kind="all_gather_sum_grad")
            total += frac * local_fraction(after[last], mesh_shape)
        else:
            steps.append(Step(axis, "grad_all_reduce"))
            total += 2 * frac * s
    return steps, total
