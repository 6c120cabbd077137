"""Mutants of gradient sync (``nnscaler/runtime/grad_sync.py``: buckets, their all-reduces)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._base import _GS, mutant, patch, swapped


def _around_launch(around) -> None:
    """``GradSync._launch`` (a bucket's all-reduce) becomes ``around(launch, self, bucket)``, ``launch``
    the real one."""
    GS = _GS().GradSync
    launch = GS._launch
    patch(GS, "_launch", lambda self, b: around(launch, self, b))


@mutant
def grad_sync_missing():
    patch(_GS().GradSync, "attach", lambda self: None)


@mutant
def grad_sync_averages():
    def mean(launch, self, b):
        launch(self, b)
        b.handle.wait()
        b.flat /= dist.get_world_size(b.group)
    _around_launch(mean)


@mutant
def grad_sync_offset_not_reset():
    GS = _GS().GradSync

    def finish(self):
        for b in self.buckets:
            if id(b) not in self._schedule.launched:
                self._launch(b)
        offset = 0
        for b in self.buckets:
            b.handle.wait()
            for p in b.params:
                n = p.numel()
                piece = b.flat[offset % max(b.flat.numel(), 1):][:n]
                if piece.numel() < n:
                    piece = torch.cat([piece, b.flat[: n - piece.numel()]])
                p.grad = piece.view_as(p).clone()
                offset += n
            b.flat, b.handle = None, None
    patch(GS, "_complete", finish)


@mutant
def grad_sync_on_the_world_group():
    def on_world(launch, self, b):
        with swapped(b, "group", None):  # None: the default group, every rank
            launch(self, b)
    _around_launch(on_world)


class _NotIssued:
    """The handle of a collective that was never issued."""

    def wait(self):
        return True


@mutant
def grad_sync_first_bucket_only():
    def first_only(launch, self, b):
        if b is self.buckets[0]:
            return launch(self, b)
        # the other buckets keep this rank's own grads
        with swapped(dist, "all_reduce", lambda *args, **kwargs: _NotIssued()):
            launch(self, b)
    _around_launch(first_only)


@mutant
def grad_sync_bucket_keeps_stale_params():
    def lose_last(launch, self, b):
        b.params[-1].grad = torch.zeros_like(b.params[-1])  # the bucket's last gradient is lost
        launch(self, b)
    _around_launch(lose_last)
