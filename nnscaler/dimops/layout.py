"""Placements of a tensor on one axis of a rank mesh: split (D), replicated (R), partial value (V)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """Split along tensor dim ``dim`` into equal chunks, one per coordinate (D).

    ``blocks`` > 1 splits one factor of a fused dim: the dim is ``blocks`` equal contiguous blocks
    (the q, k and v of a fused projection) and each coordinate holds its chunk of every block, in
    block order (``D2/3``). ``blocks == 1`` is a plain contiguous chunk (``D2``)."""

    dim: int
    blocks: int = 1

    def __str__(self) -> str:
        return f"D{self.dim}" if self.blocks == 1 else f"D{self.dim}/{self.blocks}"

    @classmethod
    def parse(cls, text: str) -> "Shard":
        """Inverse of ``str``: ``D2`` or ``D2/3``."""
        dim, _, blocks = text[1:].partition("/")
        return cls(int(dim), int(blocks or 1))


@dataclass(frozen=True)
class Replicate:
    """Every coordinate holds the whole tensor (R)."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """Every coordinate holds a partial value; the tensor is their sum (V)."""

    def __str__(self) -> str:
        return "V"


Placement = Shard | Replicate | Partial
Layout = tuple[Placement, ...]  # one placement per mesh axis


def layout_str(layout: Layout | None) -> str:
    """``D0xR``-style text for a layout (``-`` for a non-tensor)."""
    return "-" if layout is None else "x".join(str(p) for p in layout) or "R"


def piece(shape: tuple[int, ...], layout: Layout, mesh_shape: tuple[int, ...], coords: tuple[int, ...]) -> tuple:
    """Where the piece a mesh coordinate holds lies, per dim: ``(start, stop)`` or, for a dim split
    in blocks, ``(start, stop, blocks)`` (that range inside each of the ``blocks`` equal blocks)."""
    out: list[tuple] = [(0, n) for n in shape]
    for axis, q in enumerate(layout):
        if not isinstance(q, Shard) or mesh_shape[axis] == 1:  # one rank on the axis: it holds it all
            continue
        start, stop, *blk = out[q.dim]
        if blk or (q.blocks > 1 and (start, stop) != (0, shape[q.dim])):
            raise ValueError(f"layout {layout_str(layout)}: a dim split in blocks cannot be split again")
        stop = stop if q.blocks == 1 else stop // q.blocks
        step = (stop - start) // mesh_shape[axis]
        lo, hi = start + coords[axis] * step, start + (coords[axis] + 1) * step
        out[q.dim] = (lo, hi) if q.blocks == 1 else (lo, hi, q.blocks)
    return tuple(out)


def take_piece(full, slices):
    """The piece of tensor ``full`` at ``slices`` (as :func:`piece` gives them)."""
    x = full
    for d, (start, stop, *blk) in enumerate(slices):
        if blk:
            x = x.unflatten(d, (blk[0], -1))[(slice(None),) * (d + 1) + (slice(start, stop),)].flatten(d, d + 1)
        else:
            x = x[(slice(None),) * d + (slice(start, stop),)]
    return x


def join_blocks(parts, dim: int, blocks: int):
    """The whole tensor from per-coordinate pieces of a dim split in ``blocks`` (torch tensors)."""
    import torch
    if blocks == 1:
        return torch.cat(parts, dim=dim)
    chunks = [p.unflatten(dim, (blocks, -1)) for p in parts]
    return torch.cat(chunks, dim=dim + 1).flatten(dim, dim + 1)
