"""ZeRO 3: parameters sharded over the zero group, each bucket gathered when the generated program
reads it and freed when nothing holds it any more (``ComputeConfig(zero=3)``).

The buckets and shards are :class:`~nnscaler.runtime.zero.ZeroShards`'; this module holds what runs
around the generated program:

- :class:`GatheredParams`, the mapping the program reads its parameters from (``p['h.0.attn.c_attn.weight']``,
  at each use): the first read of a bucket's parameter all-gathers the bucket (:class:`_Gather`, an
  autograd function of the rank's shard whose outputs are the bucket's parameters, as views of one new
  buffer); the mapping keeps the last :data:`KEEP` buckets, so a block's parameters are gathered once
  per forward, and the buffer is freed (by reference counting) once no tensor of the program holds it.
- :func:`saved_hooks`: autograd keeps, for backward, the parameters (or views of them) an operator
  saved; these saved-tensor hooks keep only where they were in the bucket, and backward gathers the
  bucket again (once, until its gradient is reduced: :meth:`ZeroShards.regather`). Any saved-tensor
  hooks already open (a memory measurement) still see every other tensor.
- :class:`_Gather`'s backward reduce-scatters the bucket's gradients into the shard's
  (:meth:`ZeroShards.scatter_grads`), after summing a gradient over another mesh axis first.

Why not torch's ``fully_shard`` (FSDP2): it gathers per ``nn.Module`` around ``module.__call__``, but the
generated program is one flat function over a dict of parameters (no module per block to wrap, so one
group: the whole model gathered at once); it replaces the parameters by ``DTensor``s and reduces their
gradients itself with one divide factor per group, while here a gradient partial over the plan's ``dp``
axis is summed and a complete one averaged, and one split on a tensor-parallel axis is summed there
first (:mod:`.grad_sync`); and the checkpoints, clipping and state dicts speak plain local pieces.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Iterator

import torch

from .zero import ZeroBucket, ZeroShards

KEEP = 2  # buckets the forward keeps gathered (the block being run and the one before)
_TAG = "_nnscaler_zero3"  # attribute of a gathered buffer: its bucket


class _Gather(torch.autograd.Function):
    """``shard`` -> the bucket's parameters (views of a new all-gathered buffer); backward
    reduce-scatters their gradients into the shard's."""

    @staticmethod
    def forward(ctx, shard, shards: ZeroShards, b: ZeroBucket):
        flat = shards.gathered(b)
        setattr(flat, _TAG, b)
        ctx.shards, ctx.bucket = shards, b
        ctx.set_materialize_grads(False)
        return tuple(flat[off:off + p.numel()].view_as(p) for p, off in zip(b.params, b.offsets))

    @staticmethod
    def backward(ctx, *grads):
        ctx.shards.scatter_grads(ctx.bucket, grads)
        ctx.shards.release(ctx.bucket)  # every operator that read the bucket has run its backward
        return None, None, None


class GatheredParams(Mapping):
    """What one forward of the generated program reads its state from: a zero 3 parameter from its
    gathered bucket, anything else from ``local``."""

    def __init__(self, shards: ZeroShards, local: dict[str, torch.Tensor], where: dict[str, tuple[ZeroBucket, int]]):
        self._shards, self._local, self._where = shards, local, where
        self._cache: OrderedDict[int, tuple[torch.Tensor, ...]] = OrderedDict()

    def __getitem__(self, name: str) -> torch.Tensor:
        hit = self._where.get(name)
        if hit is None:
            return self._local[name]
        b, i = hit
        views = self._cache.get(id(b))
        if views is None:
            views = self._cache[id(b)] = _Gather.apply(b.shard, self._shards, b)
            while len(self._cache) > KEEP:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(id(b))
        return views[i]

    def __iter__(self):
        return iter(self._local)

    def __len__(self) -> int:
        return len(self._local)

    def close(self) -> None:
        """After the forward: hold nothing (a recomputed block reading the mapping gathers again)."""
        self._cache.clear()


class _Saved:
    """Where a saved tensor lay in a gathered bucket."""

    __slots__ = ("bucket", "size", "stride", "offset")

    def __init__(self, bucket: ZeroBucket, t: torch.Tensor):
        self.bucket, self.size, self.stride, self.offset = bucket, t.size(), t.stride(), t.storage_offset()


class _Outer:
    __slots__ = ("packed",)

    def __init__(self, packed):
        self.packed = packed


def _bucket_of(t: torch.Tensor) -> ZeroBucket | None:
    base = t._base if t._base is not None else t
    return getattr(base, _TAG, None)


@contextmanager
def saved_hooks(shards: ZeroShards) -> Iterator[None]:
    """Saved-tensor hooks for one forward (see the module's docstring)."""
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)  # e.g. a memory measurement's

    def pack(t: torch.Tensor):
        b = _bucket_of(t)
        if b is not None:
            return _Saved(b, t)
        return _Outer(outer[0](t)) if outer else t

    def unpack(x):
        if isinstance(x, _Saved):
            return shards.regather(x.bucket).as_strided(x.size, x.stride, x.offset)
        return outer[1](x.packed) if isinstance(x, _Outer) else x

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
