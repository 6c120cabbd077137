"""Rank meshes on a live process group: which sub-group each mesh axis talks over."""
from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from ..dimops.partition import axis_groups, coords


def backend_device(group=None) -> torch.device:
    """The device a process group's backend moves tensors on: the current GPU for nccl, else the CPU
    (gloo ranks compute on the CPU even on a machine that has a GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class GroupCache:
    """Process groups keyed by their ranks. Every rank must create the same groups in the same order,
    so create them all up front with :meth:`create_for_shapes` (``new_group`` is collective)."""

    def __init__(self, timeout: datetime.timedelta | None = None):
        self._groups: dict[tuple[int, ...], object] = {}
        self._timeout = timeout

    def create_for_shapes(self, shapes: Iterable[Sequence[int]], offset: int = 0) -> None:
        """Create every axis group of every mesh shape (ranks ``offset .. offset + prod(shape)``)."""
        wanted = sorted({tuple(r + offset for r in g)
                         for shape in shapes for groups in axis_groups(shape) for g in groups if len(g) > 1})
        for ranks in wanted:
            if ranks not in self._groups:
                self._groups[ranks] = dist.new_group(list(ranks), timeout=self._timeout)

    def add(self, ranks: Sequence[int]):
        """Create the group of exactly ``ranks`` if it is not held yet (collective: every rank calls
        this for the same groups in the same order) and return it."""
        ranks = tuple(ranks)
        if ranks not in self._groups:
            self._groups[ranks] = dist.new_group(list(ranks), timeout=self._timeout)
        return self._groups[ranks]

    def get(self, ranks: Sequence[int]):
        """The group of exactly ``ranks`` (``None`` for a single rank)."""
        ranks = tuple(ranks)
        if len(ranks) == 1:
            return None
        if ranks not in self._groups:
            raise KeyError(f"no process group for ranks {ranks}; create it with GroupCache.create_for_shapes")
        return self._groups[ranks]


@dataclass(frozen=True)
class RankMesh:
    """This rank's place in a mesh of ``shape`` laid over global ranks ``offset ..``."""

    shape: tuple[int, ...]
    rank: int
    groups: tuple[object, ...]  # this rank's group on each axis
    offset: int = 0

    @property
    def coords(self) -> tuple[int, ...]:
        return coords(self.rank - self.offset, self.shape)

    @classmethod
    def build(cls, shape: Sequence[int], rank: int, cache: GroupCache, offset: int = 0) -> "RankMesh":
        shape = tuple(shape)
        if not offset <= rank < offset + math.prod(shape):
            raise ValueError(f"rank {rank} is not in a mesh of shape {shape} at offset {offset}")
        mine = []
        for groups in axis_groups(shape):
            g = next(g for g in groups if rank - offset in g)
            mine.append(cache.get([r + offset for r in g]))
        return cls(shape, rank, tuple(mine), offset)


def mesh_shapes(world_size: int) -> list[tuple[int, ...]]:
    """Every ordered factorisation of ``world_size`` into factors >= 2 (the meshes partitions use)."""
    if world_size == 1:
        return [()]
    out = []
    for f in range(2, world_size + 1):
        if world_size % f == 0:
            out += [(f,) + rest for rest in mesh_shapes(world_size // f)]
    return out
