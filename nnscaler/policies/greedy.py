"""A layout-following planner shared by the built-in policies.

Operators are visited in program order. For each, every partition on the plan mesh that the policy
allows is scored by the communication its inputs need to reach the layouts it wants (bytes, from
:func:`nnscaler.comm.conversion.conversion`) plus its compute (the product of its identifiers'
lengths, divided by the split degree, weighted by ``COMPUTE_WEIGHT``: moving a byte costs more than
a multiply-add). The cheapest wins (the first, on a tie). Parameters take
the layout their first consumer wants, so they cost nothing to reach. A partial output is charged
part of the all-reduce it will need (``PENDING_WEIGHT``): the one look-ahead that turns greedy
choices into Megatron's column-then-row pairs.
"""
from __future__ import annotations

import itertools
import math
from typing import Callable, Collection, Sequence

from ..comm.conversion import conversion, local_fraction
from ..dimops.layout import Layout, Partial, Replicate, Shard
from ..dimops.partition import Partition, nested_splits, split_factor, splittable
from ..ir.graph import BUFFER, CONSTANT, PARAM, IRGraph, IROp, IRTensor, tensors_in
from ..ir.plan import Plan

COMPUTE_WEIGHT = 0.05
PENDING_WEIGHT = 0.5  # a partial output is charged half its all-reduce now: a consumer may absorb it

# (op, axis, layouts of tensors so far) -> identifiers the policy allows on that axis
AxisOptions = Callable[[IROp, int, dict], Sequence[str | None]]


def fused_blocks(graph: IRGraph) -> dict[str, dict[str, int]]:
    """Per operator, the identifiers whose split must cut a fused dim in blocks, and their count.

    A consumer that cuts a dim into a fixed number of pieces (``split`` of a fused qkv: ``a b (3
    d)``) holds each piece's chunk when ``d`` is split; its producers (the fused projection, and any
    reshape between) then split their identifier for that dim in as many blocks, so the projection's
    weight rows are stored as Megatron stores them: this rank's heads of q, of k and of v. Found by
    one pass against program order."""
    want: dict[tuple[IRTensor, int], int] = {}
    out: dict[str, dict[str, int]] = {}
    for op in reversed(graph.ops):
        if not op.known:
            continue
        hint: dict[str, int] = {}
        for t, dims in zip(op.outputs, op.bound.outputs):
            for d, ids in enumerate(dims or ()) if t is not None else ():
                k = want.get((t, d), 1)
                if k > 1 and not ids[0].isdigit():
                    hint[ids[0]] = k
        for x, dims in zip(op.inputs, op.bound.inputs):
            if not isinstance(x, IRTensor) or dims is None:
                continue
            for d, ids in enumerate(dims):
                lead = list(itertools.takewhile(str.isdigit, ids))
                if lead and len(lead) < len(ids):
                    want[(x, d)] = math.prod(map(int, lead))
                elif ids[0] in hint:
                    want[(x, d)] = hint[ids[0]]
        if hint:
            out[op.name] = hint
    return out


def candidates(op: IROp, mesh_shape: Sequence[int], options: AxisOptions, layouts: dict,
               blocks: dict[str, int] | None = None, nested: bool = False) -> list[Partition]:
    """Every partition of ``op`` on the mesh: one identifier (or None) per axis, each at most once
    (``nested``: an identifier may be split on several axes, each cutting the piece the lower one gives,
    :func:`~nnscaler.dimops.partition.repeated`), each dividing its length, drawn from the policy's options
    for that axis; an identifier in ``blocks`` is cut in that many blocks where its length allows (never for
    an operator with a partition-aware kernel, which indexes contiguous chunks)."""
    ok = set(splittable(op.bound))
    blocks = {} if op.spec.local is not None else (blocks or {})
    held = held_blocks(op, layouts)
    if op.spec.local is not None:  # a partition-aware kernel indexes contiguous chunks, bar these
        held = {i: k for i, k in held.items() if i in op.spec.unordered}
    per_axis = []
    for axis, f in enumerate(mesh_shape):
        if f == 1:  # a degenerate axis splits nothing
            per_axis.append([None])
            continue
        per_axis.append([i for i in options(op, axis, layouts)
                         if i is None or (i in ok and op.bound.sizes[i] % f == 0)] or [None])
    out = _combinations(op, mesh_shape, per_axis, blocks, held, nested)
    if not out:  # every axis offers only the same identifier (a square logits' loss, n x n): leave axes whole too
        out = _combinations(op, mesh_shape, [axis + [None] if None not in axis else axis for axis in per_axis],
                            blocks, held)
    return out


def held_blocks(op: IROp, layouts: dict) -> dict[str, int]:
    """Identifiers whose dim an input already holds split in blocks (``D0/4``: a ``(b h)`` merge of
    heads into the batch split by heads, read by a ``bmm`` whose ``b`` is that merged dim): a split of
    one of them may follow those blocks, and so need no conversion."""
    out: dict[str, int] = {}
    for x, dims in zip(op.inputs, op.bound.inputs):
        lay = layouts.get(x) if isinstance(x, IRTensor) else None
        for q in lay or ():
            if isinstance(q, Shard) and q.blocks > 1 and q.dim < len(dims or ()) and len(dims[q.dim]) == 1:
                out.setdefault(dims[q.dim][0], q.blocks)
    return out


def _combinations(op: IROp, mesh_shape: Sequence[int], per_axis: list[list], blocks: dict[str, int],
                  held: dict[str, int] | None = None, nested: bool = False) -> list[Partition]:
    """A partition per choice of one option per axis, each identifier used once (``nested``: or on several
    axes, its length divided by all of them, never in blocks) and never two factors of one merged dim; an
    identifier in ``held`` also in its blocks (both variants)."""
    out = []
    for combo in itertools.product(*per_axis):
        named = [i for i in combo if i is not None]
        if nested_splits(op.bound, named) is not None:
            continue
        twice = {i for i in named if named.count(i) > 1}
        if twice and (not nested or any(op.bound.sizes[i] % math.prod(f for j, f in zip(combo, mesh_shape) if j == i)
                                        for i in twice)):
            continue
        cut = tuple((i, blocks[i]) for i, f in zip(combo, mesh_shape)
                    if i in blocks and i not in twice and op.bound.sizes[i] % (f * blocks[i]) == 0)
        p = Partition(tuple(zip(combo, mesh_shape)), math.prod(mesh_shape), cut)
        if twice and _nested_in_blocks(op, p):
            continue
        out.append(p)
        follow = tuple((i, held[i]) for i, f in zip(combo, mesh_shape)
                       if i in (held or {}) and i not in blocks and i not in twice
                       and op.bound.sizes[i] % (f * held[i]) == 0)
        if follow:
            out.append(Partition(out[-1].splits, out[-1].world_size, cut + follow))
    return out


def _nested_in_blocks(op: IROp, p: Partition) -> bool:
    """Whether a dim ``p`` splits on several axes is, on some tensor, a merged dim split in blocks (``(b s)``
    split by ``s``): a layout cannot cut a split in blocks again (:mod:`nnscaler.comm.conversion`)."""
    lay = op.layout(p)
    for one in [*lay.inputs, *lay.outputs]:
        shards = [q for q in one or () if isinstance(q, Shard)]
        if any(q.blocks > 1 and sum(o.dim == q.dim for o in shards) > 1 for q in shards):
            return True
    return False


def numel(t: IRTensor) -> int:
    return math.prod(t.shape)


def _free(t: IRTensor, layouts: dict) -> bool:
    return t.kind in (PARAM, BUFFER, CONSTANT) and t not in layouts  # lifted constants live like buffers


def score(op: IROp, p: Partition, layouts: dict[IRTensor, Layout], mesh_shape: Sequence[int],
          made: set | None = None, grads: set | None = None) -> float:
    """Bytes moved to feed ``op`` under ``p`` plus its weighted compute. A conversion an earlier
    consumer already made (in ``made``) is free: the program reuses it (q, k and v of one input)."""
    lay = op.layout(p)
    cost = 0.0
    for x, want in zip(op.inputs, lay.inputs):
        if isinstance(x, IRTensor) and want is not None and not _free(x, layouts):
            if made is not None and _conversion_key(x, want, p) in made:
                continue
            grad = x.dtype.is_floating_point if grads is None else x in grads
            cost += conversion(layouts[x], want, p.axis_ids, mesh_shape, len(x.shape), grad)[1] * numel(x)
    for t, lay_out in zip(op.outputs, lay.outputs):  # a partial result will have to be summed
        if t is not None and lay_out is not None:
            for f, q in zip(mesh_shape, lay_out):
                if isinstance(q, Partial):  # over this rank's share, as conversion costs count it
                    cost += PENDING_WEIGHT * 2 * (f - 1) / f * numel(t) * local_fraction(lay_out, mesh_shape)
    work = math.prod(op.bound.sizes.values()) if op.bound.sizes else 1
    return cost + COMPUTE_WEIGHT * work / p.degree


def _conversion_key(x: IRTensor, want: Layout, p: Partition) -> tuple:
    return (x, want, tuple(i is not None for i in p.axis_ids))


def _partial_outputs(op: IROp, p: Partition) -> int:
    return sum(isinstance(q, Partial) for lay in op.layout(p).outputs if lay is not None for q in lay)


def plan_greedy(graph: IRGraph, mesh_shape: tuple[int, ...], axis_names: tuple[str, ...], options: AxisOptions,
                policy: str, pick: Callable[[IROp, list[Partition]], Partition] | None = None,
                nested: Collection[str] = ()) -> Plan:
    """Plan every known operator greedily in program order (``pick`` overrides the choice; the operators named
    in ``nested`` may split one identifier on several axes, :func:`candidates`)."""
    plan = Plan(mesh_shape, axis_names, policy=policy)
    everywhere_r = tuple(Replicate() for _ in mesh_shape)
    layouts: dict[IRTensor, Layout] = {t: everywhere_r for t in graph.inputs}
    fused = fused_blocks(graph)
    made: set = set()  # conversions the program already makes (reused by later consumers)
    grads = graph.carries_grad()
    late = stored_checks(graph) if pick is None else set()
    for op in [o for o in graph.ops if o.name not in late] + [o for o in graph.ops if o.name in late]:
        if not op.known:
            for x in op.tensor_inputs():
                layouts.setdefault(x, everywhere_r)
            for t in op.outputs:
                if t is not None:
                    layouts[t] = everywhere_r
            continue
        cands = candidates(op, mesh_shape, options, layouts, fused.get(op.name), op.name in nested)
        if pick is not None:
            best = pick(op, cands)
        else:  # on a tie, the partition leaving fewer partial sums (column- before row-split)
            best = min(cands, key=lambda p: (round(score(op, p, layouts, mesh_shape, made, grads), 6), _partial_outputs(op, p)))
        plan.partitions[op.name] = best
        lay = op.layout(best)
        for x, want in zip(op.inputs, lay.inputs):
            if isinstance(x, IRTensor) and want is not None:
                made.add(_conversion_key(x, want, best))
            if isinstance(x, IRTensor) and want is not None and _free(x, layouts):
                # a parameter is stored split or whole; a partial value is made from it each use
                layouts[x] = tuple(Replicate() if isinstance(q, Partial) else q for q in want)
        for t, out in zip(op.outputs, lay.outputs):
            if t is not None and out is not None:
                layouts[t] = out
    return plan


def stored_checks(graph: IRGraph) -> set[str]:
    """Operators that only check a parameter, buffer or constant (``.to(dtype)``'s
    ``_assert_tensor_metadata``: an output nothing reads). Planned last, they follow the layout the
    tensor's real reader chose; planned first, they would fix its storage by their own whim (a
    router's weight stored split by its dtype check, then gathered every step for a router kept whole)."""
    read = {id(t) for op in graph.ops for t in op.tensor_inputs()} | {id(t) for t in tensors_in(graph.outputs)}
    return {op.name for op in graph.ops
            if op.known and op.outputs and all(t is None or id(t) not in read for t in op.outputs)
            and any(x.kind in (PARAM, BUFFER, CONSTANT) for x in op.tensor_inputs())}


def sharded_identifiers(op: IROp, axis: int, layouts: dict) -> list[str]:
    """Identifiers of ``op`` whose dims its inputs already hold split along ``axis``."""
    out = []
    for x, dims in zip(op.inputs, op.bound.inputs):
        lay = layouts.get(x) if isinstance(x, IRTensor) else None
        if lay is not None and dims is not None and isinstance(lay[axis], Shard) and lay[axis].dim < len(dims):
            ids = dims[lay[axis].dim]  # (b h) held in b blocks: h; (3 d): d
            out.append(split_factor(ids, lay[axis].blocks, op.bound) or split_factor(ids, 1, op.bound))
    return out


def parameter_identifiers(op: IROp) -> list[str]:
    """Identifiers of ``op`` that name a dim of one of its parameters."""
    return [ids[0] for x, dims in zip(op.inputs, op.bound.inputs)
            if isinstance(x, IRTensor) and x.kind == PARAM and dims for ids in dims]
