"""Placements of a tensor on one axis of a rank mesh: split (D), replicated (R), partial value (V)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """Split along tensor dim ``dim`` into equal contiguous chunks, one per coordinate (D)."""

    dim: int

    def __str__(self) -> str:
        return f"D{self.dim}"


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
