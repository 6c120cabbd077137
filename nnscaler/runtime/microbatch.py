"""Micro-batches and gradient accumulation: split a batch, weigh each micro-batch's loss, and finish
with the gradient of the WHOLE batch's loss (loss scaled per batch, never per micro-batch).

A loss that is a mean over a number of elements that varies between micro-batches (cross entropy
with ``ignore_index`` over unevenly padded targets) cannot be recovered from the micro-batch means
alone: the whole batch's loss is ``sum(loss_sum_i) / sum(count_i)``, not the mean of the means. So
every micro-batch's loss is taken as a pair ``(loss_sum, count)``:

- a loss function (or the module's own output) may return that pair itself: the sum of the
  per-element losses and how many elements it summed (e.g. ``F.cross_entropy(..., reduction="sum")``
  and ``(targets != ignore_index).sum()``);
- a plain scalar is read as a mean over a number of elements proportional to the micro-batch's rows
  (exact for every loss that averages a fixed number of elements per row; equal micro-batches then
  weigh equally): ``(loss * rows, rows)``.

Each micro-batch's backward runs on its ``loss_sum``; after the last one (and the gradient sync) the
accumulated gradients are divided by the total count. Across data-parallel replicas the counts and
sums are all-reduced, so the gradient is that of the whole global batch's loss, however the elements
fall between replicas. The pipeline runtime reuses :func:`split_batch`, :func:`loss_terms` and
:class:`Accumulation`.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from .shard_grad import real


class MicroBatchError(ValueError):
    """A batch that cannot be split into the configured micro-batches, or a loss of the wrong kind."""


def _is_batched(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() > 0


def batch_rows(args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> int:
    """The rows (dim 0) of the first batched tensor among ``args`` and ``kwargs`` (0 when none)."""
    for x in (*args, *(kwargs or {}).values()):
        if _is_batched(x):
            return x.shape[0]
    return 0


def check_divisible(args: Sequence[Any], kwargs: Mapping[str, Any] | None, num_microbatches: int) -> None:
    """Raise :class:`MicroBatchError` unless every tensor argument with a dim 0 splits into
    ``num_microbatches`` equal parts."""
    named = [(f"argument {i}", x) for i, x in enumerate(args)] + [(f"argument {k!r}", x) for k, x in (kwargs or {}).items()]
    batched = [(n, x) for n, x in named if _is_batched(x)]
    if num_microbatches > 1 and not batched:
        raise MicroBatchError(f"num_microbatches={num_microbatches} but the batch has no tensor with a dim 0 to split")
    for name, x in batched:
        if x.shape[0] % num_microbatches:
            raise MicroBatchError(f"batch {name} has {x.shape[0]} rows (dim 0), not divisible by num_microbatches="
                                  f"{num_microbatches}; give a multiple of {num_microbatches} rows or change "
                                  f"num_microbatches")


def split_batch(args: Sequence[Any], kwargs: Mapping[str, Any] | None, num_microbatches: int
                ) -> list[tuple[tuple, dict]]:
    """``num_microbatches`` pairs ``(args, kwargs)``: every tensor with a dim 0 split into equal
    consecutive chunks along it; anything else (scalars, 0-dim tensors, options) passed to each."""
    kwargs = dict(kwargs or {})
    check_divisible(args, kwargs, num_microbatches)
    if num_microbatches == 1:
        return [(tuple(args), kwargs)]

    def piece(x, i):
        return x.chunk(num_microbatches)[i] if _is_batched(x) else x

    return [(tuple(piece(a, i) for a in args), {k: piece(v, i) for k, v in kwargs.items()})
            for i in range(num_microbatches)]


def loss_terms(loss: Any, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's loss as ``(loss_sum, count)`` (see the module docstring): a pair is taken as
    it is; a scalar as a mean over ``rows``-proportional elements, ``(loss * rows, rows)``."""
    if isinstance(loss, (tuple, list)) and len(loss) == 2:
        total, count = loss
        count = torch.as_tensor(count, dtype=torch.float64).detach()
        if count.numel() != 1:
            raise MicroBatchError(f"a (loss_sum, count) loss needs a scalar count, got shape {tuple(count.shape)}")
    else:
        total, count = loss, None
    if not isinstance(total, torch.Tensor) or total.numel() != 1 or not total.is_floating_point():
        what = f"a tensor of shape {tuple(total.shape)}" if isinstance(total, torch.Tensor) else type(total).__name__
        raise MicroBatchError(f"train_step needs a scalar floating loss or a (loss_sum, count) pair from the module or "
                              f"loss_fn, got {what}; pass loss_fn=... to turn the module's output into one")
    if count is None:
        return total.reshape(()) * rows, torch.tensor(float(rows), dtype=torch.float64)
    return total.reshape(()), count.reshape(())


@dataclass
class Accumulation:
    """Gradient accumulation over one batch. :meth:`begin` sets aside gradients already held (they
    are added back at the end, as plain ``backward`` calls would accumulate them); :meth:`add`
    records each micro-batch's ``(loss_sum, count)``; :meth:`finish` divides the accumulated
    gradients by the total count (summed over the ``replica_group`` too) and returns the loss of the
    whole batch, detached."""

    params: list[torch.nn.Parameter]
    replica_group: Any = None
    replicas: int = 1  # the gradient sync averages over replicas: undone in finish
    stash: dict[int, torch.Tensor | None] = field(default_factory=dict)
    loss_sum: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    count: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))

    @classmethod
    def begin(cls, params: Iterable[torch.nn.Parameter], replica_group=None, replicas: int = 1) -> "Accumulation":
        acc = cls([p for p in params if p.requires_grad], replica_group, replicas)
        for p in acc.params:
            acc.stash[id(p)], p.grad = real(p.grad), None  # a zero 2/3 placeholder: its shard is stashed
        return acc

    def add(self, loss_sum: torch.Tensor, count: torch.Tensor) -> None:
        self.loss_sum = self.loss_sum + loss_sum.detach().double()
        self.count = self.count + count.double()

    def finish(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        totals = torch.stack([self.loss_sum, self.count])
        if self.replica_group is not None and self.replicas > 1:
            dist.all_reduce(totals, group=self.replica_group)
        loss_sum, count = totals
        if not count > 0:
            raise MicroBatchError(f"the batch's loss counts add up to {float(count)}; a (loss_sum, count) loss needs "
                                  f"a positive total count")
        scale = self.replicas / float(count)  # the sync averaged over replicas: a sum over them, then / count
        with torch.no_grad():
            for p in self.params:
                cur = real(p.grad)  # a zero 2/3 placeholder's slices are the shard's, scaled with it
                if cur is not None:
                    cur.mul_(scale)
                old = self.stash.pop(id(p), None)
                if old is not None:
                    p.grad = old if cur is None else cur.add_(old)
        return (loss_sum / count).to(dtype)


def accumulate(forward: Callable[..., Any], batch: Sequence[Any], batch_kwargs: Mapping[str, Any] | None,
               num_microbatches: int, loss_fn: Callable[..., Any] | None, params: Iterable[torch.nn.Parameter],
               no_sync: Callable[[], ContextManager], replica_group=None, replicas: int = 1) -> torch.Tensor:
    """Forward and backward of every micro-batch of ``batch`` (``no_sync()`` around all but the last,
    so gradients are synchronised once); return the whole batch's loss. ``loss_fn(output, *args,
    **kwargs)`` of each micro-batch, or the output itself, gives a scalar mean or a ``(loss_sum,
    count)`` pair (:func:`loss_terms`)."""
    pieces = split_batch(batch, batch_kwargs, num_microbatches)
    acc = Accumulation.begin(params, replica_group, replicas)
    dtype = torch.float32
    try:
        for i, (args, kwargs) in enumerate(pieces):
            with no_sync() if i < len(pieces) - 1 else nullcontext():
                out = forward(*args, **kwargs)
                total, count = loss_terms(out if loss_fn is None else loss_fn(out, *args, **kwargs),
                                          batch_rows(args, kwargs))
                dtype = total.dtype
                total.backward()
            acc.add(total, count)
    except BaseException:
        for p in acc.params:  # leave the gradients as they were before the step, not half accumulated
            p.grad = acc.stash.get(id(p))
        raise
    return acc.finish(dtype)
