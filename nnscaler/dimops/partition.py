"""The partition space of a bound annotation on W ranks, and the layouts a partition implies.

A :class:`Partition` gives split factors to identifiers; their product divides W and the rest of
the ranks replicate. Ranks form a mesh, one axis per split identifier (in the partition's order)
plus a trailing replication axis when the product is below W; rank ``r`` sits at the row-major
coordinates of ``r`` in that mesh.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Iterator, Sequence

from .binding import BoundAnno
from .grammar import AnnotationError, FROZEN, VALUE
from .layout import Layout, Partial, Replicate, Shard


@dataclass(frozen=True)
class Partition:
    """Split factors per identifier on ``world_size`` ranks; an empty ``splits`` replicates.

    Each entry is one mesh axis; an entry ``(None, f)`` is an axis of ``f`` ranks that replicate
    (a compiler places ops on one mesh for the whole program, so a replicated axis may sit anywhere;
    its label is ``~=f``)."""

    splits: tuple[tuple[str | None, int], ...]
    world_size: int
    blocks: tuple[tuple[str, int], ...] = ()  # split identifiers cut in blocks: (ident, count)
    balanced: tuple[str, ...] = ()  # split identifiers held in the balanced order of context parallelism

    @property
    def degree(self) -> int:
        return math.prod(f for i, f in self.splits if i is not None)

    @property
    def replicas(self) -> int:
        return self.world_size // self.degree

    @cached_property  # read per tensor of every op by layouts and code generation: computed once
    def mesh_shape(self) -> tuple[int, ...]:
        shape = tuple(f for _, f in self.splits)
        rest = self.world_size // math.prod(shape)
        return shape + ((rest,) if rest > 1 else ())

    @cached_property
    def axis_ids(self) -> tuple[str | None, ...]:
        """The identifier each mesh axis splits; ``None`` for the replication axis."""
        ids = tuple(i for i, _ in self.splits)
        return ids + ((None,) if len(self.mesh_shape) > len(ids) else ())

    def factor(self, ident: str) -> int:
        """How many pieces ``ident`` is cut in: its factor, or the product of its factors where several axes
        split it (a nested split, the lower axis first: :func:`repeated`)."""
        return math.prod(f for i, f in self.splits if i == ident and i is not None)

    def block_count(self, ident: str) -> int:
        """In how many equal blocks ``ident`` is cut before each block is split (1: plainly split)."""
        return dict(self.blocks).get(ident, 1)

    @property
    def label(self) -> str:
        """``m=2,k=2`` (``replicate`` when nothing is split); ``n=2/3``: n split in 3 blocks; ``s=2z``:
        s split in the balanced order (each rank pieces r and 2W-1-r of 2W)."""
        def one(i, f):
            k = self.block_count(i) if i is not None else 1
            return f"{'~' if i is None else i}={f}" + (f"/{k}" if k > 1 else "") + ("z" if i in self.balanced else "")
        return ",".join(one(i, f) for i, f in self.splits) or "replicate"

    @classmethod
    def parse(cls, text: str, world_size: int) -> "Partition":
        """Inverse of :attr:`label`: ``"m=2,k=2"`` or ``"replicate"``."""
        text = text.strip()
        if text in ("", "replicate"):
            return cls((), world_size)
        splits, blocks, balanced = [], [], []
        for part in text.split(","):
            name, sep, factor = part.partition("=")
            if factor.strip().endswith("z"):
                factor = factor.strip()[:-1]
                balanced.append(name.strip())
            factor, slash, count = factor.partition("/")
            if slash:
                if not count.strip().isdigit() or int(count) < 2:
                    raise AnnotationError(f"partition {text!r}: block count of {name.strip()!r} must be an integer of at least 2")
                blocks.append((name.strip(), int(count)))
            if not sep or not factor.strip().isdigit() or not name.strip():
                raise AnnotationError(f"partition {text!r}: expected IDENT=FACTOR[,IDENT=FACTOR...], e.g. 'm=2,k=2'")
            if int(factor) < 2:
                raise AnnotationError(f"partition {text!r}: split factor of {name.strip()!r} must be at least 2, got {factor}")
            splits.append((None if name.strip() == "~" else name.strip(), int(factor)))
        p = cls(tuple(splits), world_size, tuple(blocks), tuple(balanced))
        if world_size % math.prod(f for _, f in splits):
            raise AnnotationError(f"partition {text!r}: the axes multiply to {math.prod(f for _, f in splits)}, "
                                  f"which does not divide world size {world_size}")
        return p


def repeated(partition: Partition) -> set[str]:
    """Identifiers ``partition`` splits on more than one axis: a nested split of their dim, the lower mesh axis
    cutting it first and each higher one cutting the piece it is given (the layouts' convention,
    :mod:`nnscaler.comm.conversion`). Ulysses under tp cuts attention's heads on tp, then on cp."""
    named = [i for i, _ in partition.splits if i is not None]
    return {i for i in named if named.count(i) > 1}


def coords(rank: int, shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major coordinates of ``rank`` in a mesh of ``shape``."""
    out = []
    for n in reversed(shape):
        out.append(rank % n)
        rank //= n
    return tuple(reversed(out))


def axis_groups(shape: Sequence[int]) -> list[list[tuple[int, ...]]]:
    """For each mesh axis, the rank groups that vary along it (all other coordinates fixed)."""
    world = math.prod(shape)
    out = []
    for axis in range(len(shape)):
        groups: dict[tuple, list[int]] = {}
        for r in range(world):
            c = coords(r, shape)
            groups.setdefault(c[:axis] + c[axis + 1:], []).append(r)
        out.append([tuple(g) for g in groups.values()])
    return out


def prefix_size(ids: tuple[str, ...], j: int, bound: BoundAnno) -> int | None:
    """The length of the factors before factor ``j`` of a merged dim: a split of factor ``j`` holds
    that many blocks of the dim (``(3 d)``: 3; ``(b h)``, heads merged into the batch: b); ``None``
    where a factor's length is unknown."""
    n = 1
    for i in ids[:j]:
        size = int(i) if i.isdigit() else bound.sizes.get(i)
        if size is None:
            return None
        n *= size
    return n


def split_factor(ids: tuple[str, ...], blocks: int, bound: BoundAnno) -> str | None:
    """The factor of a dim written ``ids`` that a split in ``blocks`` blocks cuts: the one the factors
    before it make ``blocks`` long (``(b h)`` in b blocks: h); for plain chunks, the first factor that
    is not a number. ``None`` when no factor gives those blocks."""
    if blocks > 1 and len(ids) > 1:
        return next((i for j, i in enumerate(ids) if j and not i.isdigit() and prefix_size(ids, j, bound) == blocks), None)
    return next((i for i in ids if not i.isdigit()), None)


def splittable(bound: BoundAnno) -> list[str]:
    """Identifiers that may be split: not frozen, not a number, never one naming several dims of a
    tensor (``l l``: see :mod:`nnscaler.dimops.grammar`). A non-first factor of a merged dim stays
    hidden, unless only numbers precede it (``(3 d)``: d in 3 blocks, a fused qkv) or it also leads
    a dim of a tensor and the factors before it have known lengths (a reshape's ``a b c d -> (a b) c
    d``: heads merged into the batch, split in ``a`` blocks). A partition never splits such a factor
    together with one before it (:func:`nested_splits`)."""
    barred: set[str] = set(bound.anno.repeated())
    whole = {ids[0] for dims in bound.inputs + bound.outputs for ids in dims or ()}  # dims they lead
    for dims in bound.inputs + bound.outputs:
        for ids in dims or ():
            barred.update(i for j, i in enumerate(ids) if j and not all(x.isdigit() for x in ids[:j])
                          and (i not in whole or prefix_size(ids, j, bound) is None))
    return [i for i in bound.identifiers()
            if bound.markers.get(i) != FROZEN and i not in barred and i in bound.sizes]


def nested_splits(bound: BoundAnno, named) -> tuple[str, str] | None:
    """Two of the split identifiers ``named`` that one merged dim holds, ``(outer, inner)``: a
    layout cannot split a dim and then split each of its pieces in blocks, so no partition has both."""
    named = set(named)
    for dims in bound.inputs + bound.outputs:
        for ids in dims or ():
            cut = [i for i in ids if i in named]
            if len(cut) > 1:
                return cut[0], cut[1]
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def enumerate_partitions(bound: BoundAnno, world_size: int) -> Iterator[Partition]:
    """Every partition on ``world_size`` ranks: pure replication, then each assignment of factors
    (each dividing the identifier's length) to splittable identifiers whose product divides W."""
    ids = splittable(bound)

    def rec(start: int, remaining: int, chosen: tuple) -> Iterator[Partition]:
        yield Partition(chosen, world_size)
        for j in range(start, len(ids)):
            for f in _divisors(remaining):
                if bound.sizes[ids[j]] % f == 0 and nested_splits(bound, [i for i, _ in chosen] + [ids[j]]) is None:
                    yield from rec(j + 1, remaining // f, chosen + ((ids[j], f),))

    yield from rec(0, world_size, ())


def check_partition(bound: BoundAnno, partition: Partition) -> None:
    """Raise :class:`AnnotationError` unless ``partition`` is in the partition space of ``bound``."""
    allowed = set(splittable(bound))
    named = [i for i, _ in partition.splits if i is not None]
    twice = repeated(partition)
    if twice & (set(partition.balanced) | {i for i, _ in partition.blocks}):
        raise AnnotationError(f"partition {partition.label!r}: {sorted(twice)[0]!r} is split on two axes and in blocks "
                              f"or the balanced order; a split in blocks must be its dim's only split")
    for ident, f in partition.splits:
        if ident is None:
            continue
        if ident not in allowed:
            raise AnnotationError(f"partition {partition.label!r}: {ident!r} is not a splittable identifier of "
                                  f"{bound.anno.text!r} (splittable: {', '.join(sorted(allowed)) or 'none'})")
        if f < 2:
            raise AnnotationError(f"partition {partition.label!r}: split factor of {ident!r} must be at least 2")
        k = partition.block_count(ident) * (2 if ident in partition.balanced else 1)
        f = partition.factor(ident)  # every axis splitting it
        if bound.sizes[ident] % (f * k):
            raise AnnotationError(f"partition {partition.label!r}: {ident!r} has length {bound.sizes[ident]}, "
                                  f"not divisible by {f * k}" + (f" ({f} ranks x {k} blocks)" if k > 1 else ""))
    nested = nested_splits(bound, named)
    if nested is not None:
        raise AnnotationError(f"partition {partition.label!r}: {nested[1]!r} is a factor of the dim {nested[0]!r} "
                              f"leads, which a layout cannot split twice; split one of them")
    if set(partition.balanced) - set(named):
        raise AnnotationError(f"partition {partition.label!r}: only a split identifier can be held balanced")
    for ident, k in partition.blocks:
        if ident not in named or k < 2:
            raise AnnotationError(f"partition {partition.label!r}: blocks need a split identifier and a count of at least 2")
    axes = math.prod(f for _, f in partition.splits)
    if partition.world_size % axes:
        raise AnnotationError(f"partition {partition.label!r} needs a multiple of {axes} ranks, "
                              f"not {partition.world_size}")


def local_sizes(bound: BoundAnno, partition: Partition) -> dict[str, int]:
    """Identifier lengths on one rank under ``partition``."""
    sizes = dict(bound.sizes)
    for ident, f in partition.splits:
        if ident is not None:
            sizes[ident] //= f  # an identifier split on two axes: by both
    return sizes


@dataclass(frozen=True)
class OpLayout:
    """The layout of every input and output (``None`` for non-tensors) under one partition."""

    inputs: tuple[Layout | None, ...]
    outputs: tuple[Layout | None, ...]


def _find(dims, ident: str, bound: BoundAnno, partition: Partition) -> Shard | None:
    """The placement of a tensor with ``dims`` when ``ident`` is split: on the dim that holds it, in
    as many blocks as the factors before it hold (``(3 d)``: 3; ``(b h)``: b), times the partition's
    own blocks; ``None`` when no dim holds it."""
    for d, ids in enumerate(dims):
        for j, i in enumerate(ids):
            if i == ident:
                prefix = prefix_size(ids, j, bound)
                if prefix is not None:
                    return Shard(d, prefix * partition.block_count(ident), ident in partition.balanced)
    return None


def _tensor_layout(dims, partition: Partition, bound: BoundAnno, partial_ok: bool) -> Layout:
    """Per mesh axis: D where the tensor holds the split identifier (in blocks where it follows fixed
    counts), V where it lacks a split ``+`` identifier and may be a partial value (``partial_ok``),
    else R."""
    out = []
    markers = bound.markers
    for ident in partition.axis_ids:
        shard = None if ident is None else _find(dims, ident, bound, partition)
        if shard is not None:
            out.append(shard)
        elif ident is not None and markers.get(ident) == VALUE and partial_ok:
            out.append(Partial())
        else:
            out.append(Replicate())
    return tuple(out)


def op_layout(bound: BoundAnno, partition: Partition, partial_inputs: Sequence[bool] | None = None) -> OpLayout:
    """Layouts implied by ``partition``: a tensor holding a split identifier is split along it (D).
    An output lacking a split ``+`` identifier is a partial value (V). An input lacking one is
    replicated (R, nnScaler's rule: right for an input entering the summed computation, as in a
    fused MLP), unless the annotation writes it with a leading ``+`` (``+n, m k+, k+ n -> m n``: a
    bias added after the contraction), which makes it a partial value held by one rank (V) where
    ``partial_inputs`` allows it (floating tensors; default all). All others are replicated (R)."""
    if partial_inputs is None:
        partial_inputs = [True] * len(bound.inputs)
    elif len(partial_inputs) != len(bound.inputs):
        raise ValueError(f"partial_inputs has {len(partial_inputs)} entries for {len(bound.inputs)} inputs")
    ins = tuple(None if dims is None else _tensor_layout(dims, partition, bound, ok and t.partial)
                for dims, ok, t in zip(bound.inputs, partial_inputs, bound.anno.inputs))
    outs = tuple(None if dims is None else _tensor_layout(dims, partition, bound, True)
                 for dims in bound.outputs)
    return OpLayout(ins, outs)
