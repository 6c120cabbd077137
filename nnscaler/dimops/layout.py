"""Placements of a tensor on one axis of a rank mesh: split (D), replicated (R), partial value (V);
a split may hold its chunks in the causally balanced order of context parallelism (``D1z``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """Split along tensor dim ``dim`` into equal chunks, one per coordinate (D).

    ``blocks`` > 1 splits one factor of a fused dim: the dim is ``blocks`` equal contiguous blocks
    (the q, k and v of a fused projection) and each coordinate holds its chunk of every block, in
    block order (``D2/3``). ``blocks == 1`` is a plain contiguous chunk (``D2``).

    ``balanced`` (Llama 3's causal load balancing, ``D1z``): each block is cut in ``2n`` pieces for
    ``n`` coordinates and coordinate ``r`` holds pieces ``r`` and ``2n-1-r`` (in that order), so
    under a causal mask every coordinate's queries see as many keys (:func:`shard_indices`)."""

    dim: int
    blocks: int = 1
    balanced: bool = False

    def __str__(self) -> str:
        return (f"D{self.dim}" if self.blocks == 1 else f"D{self.dim}/{self.blocks}") + ("z" if self.balanced else "")

    @classmethod
    def parse(cls, text: str) -> "Shard":
        """Inverse of ``str``: ``D2``, ``D2/3``, ``D1z``."""
        balanced = text.endswith("z")
        dim, _, blocks = text[1:len(text) - balanced].partition("/")
        return cls(int(dim), int(blocks or 1), balanced)


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
        if q.balanced:
            raise ValueError(f"layout {layout_str(layout)}: a balanced (context-parallel) split holds two pieces "
                             f"per rank, not one range; no state is laid out so")
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


def shard_indices(length: int, n: int, r: int, blocks: int = 1, balanced: bool = False) -> list[int]:
    """The indices (along the split dim, in the order held) coordinate ``r`` of ``n`` holds of a dim of
    ``length`` split as ``Shard(dim, blocks, balanced)``."""
    if length % (n * blocks * (2 if balanced else 1)):
        raise ValueError(f"cannot split a dim of length {length} into {n} equal chunks of {blocks} blocks"
                         + (" (2 pieces each, balanced)" if balanced else ""))
    size = length // blocks
    if not balanced:
        c = size // n
        return [b * size + r * c + i for b in range(blocks) for i in range(c)]
    c = size // (2 * n)
    return [b * size + p * c + i for b in range(blocks) for p in (r, 2 * n - 1 - r) for i in range(c)]


def balanced_order(length: int, n: int, blocks: int = 1) -> list[int]:
    """The permutation (``x.index_select(dim, order)``) that puts a dim into the balanced order: its
    ``n`` contiguous chunks (of every block, as a plain split in ``blocks`` cuts them) are then the
    pieces a balanced split gives each coordinate (:func:`shard_indices`)."""
    per = [shard_indices(length, n, r, blocks, True) for r in range(n)]
    if blocks == 1:
        return [i for idx in per for i in idx]
    c = length // blocks // n  # per block: coordinate r's chunk lies at r * c of every block
    return [per[r][b * c + i] for b in range(blocks) for r in range(n) for i in range(c)]


def join_blocks(parts, dim: int, blocks: int, balanced: bool = False):
    """The whole tensor from per-coordinate pieces of a dim split in ``blocks`` (torch tensors), in
    the balanced order where ``balanced``."""
    import torch
    if balanced:
        joined = join_blocks(parts, dim, blocks)
        order = balanced_order(joined.shape[dim], len(parts), blocks)
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        return joined.index_select(dim, inverse.to(joined.device))
    if blocks == 1:
        return torch.cat(parts, dim=dim)
    chunks = [p.unflatten(dim, (blocks, -1)) for p in parts]
    return torch.cat(chunks, dim=dim + 1).flatten(dim, dim + 1)
