"""Gradient synchronisation of replicated parameters in buckets, overlapped with backward.

A parameter held whole on a mesh axis along which its consumers split their work gets a partial
gradient on each rank of that axis. Rather than summing it at every use, the generated program
leaves it partial and this hook sums it: parameters are grouped into buckets per axis group; when
every gradient of a bucket is ready it is copied into the bucket's flat buffer and all-reduced
asynchronously; at the end of backward the results are waited for. Each gradient is then a view into
its bucket's buffer (DistributedDataParallel's ``gradient_as_bucket_view``): nothing is copied back,
and a gradient accumulated into a view (``zero_grad(set_to_none=False)``) is not copied at all.

Data-parallel replicas of the plan (``runtime_ngpus > plan_ngpus``) average every gradient over the
replica group the same way, during backward. A parameter also summed within the plan is averaged
over replicas after that sum (a second stage at the end of backward); the others overlap backward.

Gradient accumulation (several backward passes, one optimizer step): inside :meth:`GradSync.paused`
the hooks do nothing, so gradients accumulate unsynchronised; the backward after it syncs the sum once
(DistributedDataParallel's ``no_sync``). A loop written for one device (every backward synced) is
right too, only slower: an average over replicas is idempotent, but a sum is not (summing a gradient
that already holds the group's sum ``S`` would count ``S`` once per rank), so a gradient that holds a
synced sum is divided by its group's size just before the next backward accumulates into it (a
hook on the parameter, which autograd runs before accumulating): the next sum then yields
``S + sum(new)``, exact for the power-of-two groups used here.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from .buckets import ReadyBuckets

BUCKET_BYTES = 4 * 2**20


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    group: object
    scale: float = 1.0  # the reduced sum is multiplied by this (1 / replicas for an average)
    deferred: bool = False  # launched only after the in-plan sums (its parameters need them first)
    flat: torch.Tensor | None = None  # allocated at the first launch, kept: the gradients are views into it
    views: list[torch.Tensor] = field(default_factory=list)  # each parameter's piece of ``flat``, shaped like it
    handle: object = None
    wire: torch.Tensor | None = None  # what is all-reduced: ``flat``, or its copy in the reduce dtype


@dataclass
class GradSync:
    """Buckets of ``(parameter, group)`` pairs; :meth:`attach` installs the hooks."""

    buckets: list[_Bucket] = field(default_factory=list)
    _synced: set = field(default_factory=set)  # ids of parameters whose .grad holds their group's sum
    reduce_dtype: torch.dtype | None = None  # bf16-mixed's grad_reduce_dtype: reduced in this dtype (None: their own)
    _schedule: ReadyBuckets | None = None

    def __post_init__(self):
        self._schedule = ReadyBuckets(lambda b: self._launch(b), lambda: self._complete())  # looked up when called

    @classmethod
    def build(cls, pairs: list[tuple[torch.nn.Parameter, object]], bucket_bytes: int | None = None,
              replicas: list[torch.nn.Parameter] = (), replica_group=None, n_replicas: int = 1,
              reduce_dtype: torch.dtype | None = None) -> "GradSync":
        """Bucket parameters (in reverse order, roughly when backward produces their gradients):
        ``pairs`` are summed over their group; ``replicas`` averaged over ``replica_group``; a bucket
        is closed once it holds ``bucket_bytes`` (default :data:`BUCKET_BYTES`)."""
        bucket_bytes = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        sync = cls(reduce_dtype=reduce_dtype)
        open_: dict[tuple, _Bucket] = {}
        in_plan = {id(p) for p, _ in pairs}
        todo = [(p, g, 1.0, False) for p, g in pairs]
        if replica_group is not None:
            todo += [(p, replica_group, 1.0 / n_replicas, id(p) in in_plan) for p in replicas]
        for p, group, scale, deferred in reversed(todo):
            key = (id(group), deferred, p.dtype, p.device)  # one buffer per bucket: one dtype, one device
            b = open_.get(key)
            if b is None or sum(q.numel() * q.element_size() for q in b.params) >= bucket_bytes:
                b = _Bucket([], group, scale, deferred)
                sync.buckets.append(b)
                open_[key] = b
            b.params.append(p)
        return sync

    def attach(self) -> None:
        self._schedule.attach(b for b in self.buckets if not b.deferred)
        for b in self.buckets:
            if b.scale == 1.0:  # a sum (not an average): a synced gradient must not be counted again
                for p in b.params:
                    p.register_hook(lambda g, p=p, b=b: self._unsum(p, b))

    def _unsum(self, p: torch.nn.Parameter, b: _Bucket) -> None:
        """Before a backward accumulates into ``p.grad``: if it holds the group's sum from an earlier
        sync, divide it by the group's size, so that the next sum counts it once."""
        if id(p) in self._synced:
            self._synced.discard(id(p))
            if p.grad is not None:
                p.grad.div_(dist.get_world_size(b.group))

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No synchronisation of the backward passes run inside: their gradients accumulate locally
        and are synced, summed with the next backward's, by the first backward after it."""
        before, self._schedule.paused = self._schedule.paused, True
        try:
            yield
        finally:
            self._schedule.paused = before

    def finish(self) -> None:
        """Sync now what the backward passes left (every bucket none of them launched) and wait."""
        self._schedule.end()

    def _launch(self, b: _Bucket) -> None:
        if b.flat is None:
            b.flat = torch.empty(sum(p.numel() for p in b.params), dtype=b.params[0].dtype, device=b.params[0].device)
            sizes = [p.numel() for p in b.params]
            b.views = [v.view_as(p) for v, p in zip(b.flat.split(sizes), b.params)]
        for p, view in zip(b.params, b.views):
            g = p.grad
            if g is None:  # no gradient on this rank: it sums zeros (and gets the others' sum)
                view.zero_()
            elif g.data_ptr() != view.data_ptr() or g.stride() != view.stride():
                view.copy_(g)
            p.grad = view  # already the view when the gradient was accumulated into it
        b.wire = b.flat if self.reduce_dtype in (None, b.flat.dtype) else b.flat.to(self.reduce_dtype)
        b.handle = dist.all_reduce(b.wire, group=b.group, async_op=True)

    def _complete(self) -> None:
        for stage in (False, True):
            buckets = [b for b in self.buckets if b.deferred == stage]
            for b in buckets:
                if id(b) not in self._schedule.launched:  # some parameter got no gradient this time, or deferred
                    self._launch(b)
            for b in buckets:
                b.handle.wait()
                if b.wire is not b.flat:  # reduced in grad_reduce_dtype: back into the gradients' own
                    b.flat.copy_(b.wire)
                if b.scale != 1.0:
                    b.flat.mul_(b.scale)
                else:
                    self._synced.update(id(p) for p in b.params)
                b.handle = None
