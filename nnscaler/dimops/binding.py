"""Binding an annotation to concrete shapes: every identifier gets its length.

``*`` is expanded into identifiers ``*0, *1, ...`` (spatial; frozen for ``*^``), so a bound annotation lists, for every
real dim of every tensor, the identifiers it is made of (one, or the factors of a group).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .grammar import AnnotationError, OpAnno, TensorAnno, SPATIAL, parse

Shape = Sequence[int]
DimIds = tuple[str, ...]  # the identifiers making up one real dim (a group has several)


@dataclass(frozen=True)
class BoundAnno:
    """An annotation bound to shapes: per tensor, per real dim, its identifiers; every length."""

    anno: OpAnno
    sizes: dict[str, int]
    inputs: tuple[tuple[DimIds, ...] | None, ...]
    outputs: tuple[tuple[DimIds, ...] | None, ...]
    markers: dict[str, str] = field(default_factory=dict)

    def shape(self, dims: tuple[DimIds, ...], sizes: dict[str, int] | None = None) -> tuple[int, ...]:
        """The shape of a tensor with these dims, under ``sizes`` (default: the full sizes)."""
        sizes = self.sizes if sizes is None else sizes
        out = []
        for ids in dims:
            n = 1
            for i in ids:
                n *= int(i) if i.isdigit() else sizes[i]
            out.append(n)
        return tuple(out)

    def identifiers(self) -> list[str]:
        """Named identifiers in order of first appearance (inputs first)."""
        seen: dict[str, None] = {}
        for t in self.inputs + self.outputs:
            for ids in t or ():
                for i in ids:
                    if not i.isdigit():
                        seen.setdefault(i)
        return list(seen)


def _where(side: str, idx: int, t: TensorAnno) -> str:
    return f"{side} {idx} ({str(t) or 'scalar'!r})"


def _expand(anno_t: TensorAnno, shape: Shape, where: str, star: list[int | None]) -> list[tuple[tuple[str, ...], int, bool]]:
    """Real dims of one tensor as (ids, size, grouped), with ``*`` expanded to ``*0, *1, ...``."""
    dims = anno_t.dims
    rank = len(shape)
    if len(dims) == 1 and not dims[0].grouped and dims[0].idents[0].name == "1" and rank == 0:
        return []  # `1` also names a 0-d tensor
    if anno_t.has_star:
        n = rank - (len(dims) - 1)
        if n < 0:
            raise AnnotationError(f"{where}: tensor has {rank} dims but the annotation needs at least {len(dims) - 1}")
        if star[0] is not None and star[0] != n:
            raise AnnotationError(f"{where}: '*' covers {n} dims here but {star[0]} elsewhere")
        star[0] = n
    elif rank != len(dims):
        raise AnnotationError(f"{where}: tensor has {rank} dims but the annotation names {len(dims)}")
    out, pos = [], 0
    for d in dims:
        if len(d.idents) == 1 and d.idents[0].is_star:
            for k in range(star[0] or 0):
                out.append(((f"*{k}",), shape[pos], False))
                pos += 1
            continue
        out.append((tuple(i.name for i in d.idents), shape[pos], d.grouped))
        pos += 1
    return out


def bind(anno: OpAnno | str, inputs: Sequence[Shape | None], outputs: Sequence[Shape] | None = None,
         known: dict[str, int] | None = None) -> BoundAnno:
    """Bind ``anno`` to input shapes (``None`` for ``?`` arguments) and, optionally, output shapes.

    Raises :class:`AnnotationError` naming the tensor, the dim and both lengths on any disagreement.
    Output-only identifiers stay unbound until output shapes are given.
    """
    anno = parse(anno) if isinstance(anno, str) else anno
    if len(inputs) != len(anno.inputs):
        raise AnnotationError(f"annotation {anno.text!r} names {len(anno.inputs)} inputs but {len(inputs)} were given")
    if outputs is not None and len(outputs) != len(anno.outputs):
        raise AnnotationError(f"annotation {anno.text!r} names {len(anno.outputs)} outputs but the op returned {len(outputs)}")
    sizes: dict[str, int] = dict(known or {})
    origin: dict[str, str] = {k: "given sizes" for k in sizes}
    star: list[int | None] = [None]
    markers = {k: v for k, v in anno.markers().items()}
    star_marker = anno.star_marker()
    groups: list[tuple[tuple[str, ...], int, str]] = []

    def bind_side(side: str, annos, shapes) -> tuple:
        bound = []
        for idx, (t, shape) in enumerate(zip(annos, shapes)):
            if t.opaque:
                bound.append(None)
                continue
            if shape is None:
                raise AnnotationError(f"{_where(side, idx, t)}: expected a tensor, got a non-tensor argument (annotate it '?')")
            where = _where(side, idx, t)
            dims = _expand(t, tuple(shape), where, star)
            for pos, (ids, n, grouped) in enumerate(dims):
                if grouped:
                    groups.append((ids, n, f"{where}, dim {pos}"))
                    continue
                (name,) = ids
                if name.isdigit():
                    if int(name) != n:
                        raise AnnotationError(f"{where}, dim {pos}: fixed length {name} but the tensor has {n}")
                    continue
                markers.setdefault(name, star_marker if name.startswith("*") else SPATIAL)
                if name in sizes and sizes[name] != n:
                    raise AnnotationError(f"{where}, dim {pos}: {name!r} is {n} here but {sizes[name]} in {origin[name]}")
                sizes.setdefault(name, n)
                origin.setdefault(name, f"{where}, dim {pos}")
            bound.append(tuple(ids for ids, _, _ in dims))
        return tuple(bound)

    bound_in = bind_side("input", anno.inputs, inputs)
    if outputs is not None:
        bound_out = bind_side("output", anno.outputs, outputs)
    else:
        bound_out = _unbound_outputs(anno, star[0])
        for dims in bound_out:
            for ids in dims or ():
                for i in ids:
                    if not i.isdigit():
                        markers.setdefault(i, star_marker if i.startswith("*") else SPATIAL)
    _solve_groups(groups, sizes, origin)
    return BoundAnno(anno, sizes, bound_in, bound_out, markers)


def _unbound_outputs(anno: OpAnno, star: int | None) -> tuple:
    """Output dims from the annotation alone (used before the op has run)."""
    out = []
    for t in anno.outputs:
        if t.opaque:
            out.append(None)
            continue
        dims = []
        for d in t.dims:
            if len(d.idents) == 1 and d.idents[0].is_star:
                dims.extend((f"*{k}",) for k in range(star or 0))
            else:
                dims.append(tuple(i.name for i in d.idents))
        out.append(tuple(dims))
    return tuple(out)


def _solve_groups(groups, sizes: dict[str, int], origin: dict[str, str]) -> None:
    pending = list(groups)
    while pending:
        progress = False
        for item in list(pending):
            ids, n, where = item
            unknown = [i for i in ids if not i.isdigit() and i not in sizes]
            prod = 1
            for i in ids:
                if i.isdigit():
                    prod *= int(i)
                elif i in sizes:
                    prod *= sizes[i]
            if len(unknown) > 1:
                continue
            pending.remove(item)
            progress = True
            if not unknown:
                if prod != n:
                    raise AnnotationError(f"{where}: group ({' '.join(ids)}) multiplies to {prod} but the tensor has {n}")
            else:
                if prod == 0 or n % prod:
                    raise AnnotationError(f"{where}: group ({' '.join(ids)}) cannot divide length {n} by {prod}")
                sizes[unknown[0]] = n // prod
                origin[unknown[0]] = where
        if not progress:
            ids, n, where = pending[0]
            raise AnnotationError(f"{where}: cannot infer the factors of ({' '.join(ids)}) from length {n}; "
                                  f"give all but one of them with sizes={{...}}")
