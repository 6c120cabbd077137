"""Whole tensors from every rank's piece, many at once: the merges behind ``ParallelModule.state_dict``
and a checkpoint's pieces split in blocks (:mod:`nnscaler.checkpoint.layout`). A model's state is
hundreds of small tensors and each collective costs a round trip, so the pieces joined along one
group go in one ``all_gather`` per dtype and bucket, not one per tensor."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..dimops.layout import join_blocks


def _runs(pieces: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``pieces`` grouped by dtype (in order of first appearance), each group cut into runs
    of at most ``bucket_bytes`` (a larger piece alone)."""
    out: list[list[int]] = []
    open_: dict[torch.dtype, tuple[list[int], int]] = {}
    for i, x in enumerate(pieces):
        size = x.numel() * x.element_size()
        run, used = open_.get(x.dtype, (None, 0))
        if run is None or (run and used + size > bucket_bytes):
            run, used = [], 0
            out.append(run)
        run.append(i)
        open_[x.dtype] = (run, used + size)
    return out


def gather_joined(pieces: Sequence[torch.Tensor], joins: Sequence[tuple[int, int]], group,
                  bucket_bytes: int) -> list[torch.Tensor]:
    """Each piece made whole over ``group`` along its ``(dim, blocks)`` of ``joins`` (see
    :func:`~nnscaler.dimops.layout.join_blocks`), the ranks' pieces in group order. Every rank of
    ``group`` calls this with pieces of the same shapes and dtypes in the same order."""
    out = list(pieces)
    for run in _runs(pieces, bucket_bytes):
        flat = torch.cat([pieces[i].contiguous().reshape(-1) for i in run])
        parts = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, flat, group=group)
        at = 0
        for i in run:
            n, (dim, blocks) = pieces[i].numel(), joins[i]
            out[i] = join_blocks([p[at:at + n].view(pieces[i].shape) for p in parts], dim, blocks)
            at += n
    return out
