"""Gradient synchronisation of replicated parameters in buckets, overlapped with backward.

A parameter held whole on a mesh axis along which its consumers split their work gets a partial
gradient on each rank of that axis. Rather than summing it at every use, the generated program
leaves it partial and this hook sums it: parameters are grouped into buckets per axis group; when
every gradient of a bucket is ready it is flattened and all-reduced asynchronously; at the end of
backward the results are waited for and copied back (as DistributedDataParallel does).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

BUCKET_BYTES = 4 * 2**20


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    group: object
    pending: int = 0
    flat: torch.Tensor | None = None
    handle: object = None


@dataclass
class GradSync:
    """Buckets of ``(parameter, group)`` pairs; :meth:`attach` installs the hooks."""

    buckets: list[_Bucket] = field(default_factory=list)
    _queued: bool = False

    @classmethod
    def build(cls, pairs: list[tuple[torch.nn.Parameter, object]], bucket_bytes: int | None = None) -> "GradSync":
        """Bucket parameters (in reverse order, roughly when backward produces their gradients); a
        bucket is closed once it holds ``bucket_bytes`` (default :data:`BUCKET_BYTES`)."""
        bucket_bytes = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        sync = cls()
        open_: dict[int, _Bucket] = {}
        for p, group in reversed(pairs):
            b = open_.get(id(group))
            if b is None or sum(q.numel() * q.element_size() for q in b.params) >= bucket_bytes:
                b = _Bucket([], group)
                sync.buckets.append(b)
                open_[id(group)] = b
            b.params.append(p)
        return sync

    def attach(self) -> None:
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(lambda p, b=b: self._ready(b))

    def _ready(self, b: _Bucket) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            for bucket in self.buckets:
                bucket.pending, bucket.handle = len(bucket.params), None
        b.pending -= 1
        if b.pending == 0:
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
        b.flat = torch.cat([g.reshape(-1) for g in grads])
        b.handle = dist.all_reduce(b.flat, group=b.group, async_op=True)

    def _finish(self) -> None:
        for b in self.buckets:
            if b.handle is None:  # some parameter got no gradient this time
                self._launch(b)
        for b in self.buckets:
            b.handle.wait()
            offset = 0
            for p in b.params:
                n = p.numel()
                p.grad = b.flat[offset:offset + n].view_as(p).clone() if p.grad is None else p.grad.copy_(
                    b.flat[offset:offset + n].view_as(p))
                offset += n
            b.flat, b.handle = None, None
        self._queued = False
