"""Operators run on every data-parallel replica's rows of the batch (:mod:`nnscaler.compile.writes`): the
inputs' batch dims gathered over the replicas' group (:data:`~.program.REPLICAS`), the operator run on the
whole batch, this replica's rows of each output kept; gradients flow back to the rows they came from
(the gather's backward sums every replica's share, the kept rows' backward pads with zeros)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from . import collectives as C
from .program import REPLICAS


class _KeepRows(torch.autograd.Function):
    """This rank's chunk along ``dim``; backward puts the gradient there and zeros elsewhere (the
    other replicas' rows take their gradient from their own ranks, summed by the gather's backward)."""

    @staticmethod
    def forward(ctx, x, dim, n, r):
        ctx.dim, ctx.n, ctx.r, ctx.size = dim, n, r, x.shape[dim]
        return x.chunk(n, dim)[r].clone()

    @staticmethod
    def backward(ctx, g):
        out = g.new_zeros(g.shape[:ctx.dim] + (ctx.size,) + g.shape[ctx.dim + 1:])
        out.narrow(ctx.dim, ctx.r * g.shape[ctx.dim], g.shape[ctx.dim]).copy_(g)
        return out, None, None, None


def gather_rows(x: Any, dim: int | None, group) -> Any:
    """Every replica's rows of ``x`` along ``dim``, in replica order (backward: each replica's share of
    the summed gradient)."""
    return x if dim is None or not isinstance(x, torch.Tensor) else C.all_gather_sum_grad(x, dim, group)


def keep_rows(x: Any, dim: int | None, group) -> Any:
    """This replica's rows of ``x`` along ``dim``."""
    if dim is None or not isinstance(x, torch.Tensor):
        return x
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if x.is_floating_point() and x.requires_grad:
        return _KeepRows.apply(x, dim, n, r)
    return x.chunk(n, dim)[r].clone()


def over_replicas(fn: Callable, in_dims: Sequence[int | None], out_dims: Sequence[int | None], *args, **kwargs):
    """``fn(*args, **kwargs)`` on every replica's rows: argument ``i`` gathered along ``in_dims[i]`` over
    the replicas running now, this replica's rows of output ``j`` kept along ``out_dims[j]``; without
    replicas, ``fn`` as it is."""
    group = REPLICAS.get()
    if group is None:
        return fn(*args, **kwargs)
    args = [gather_rows(a, d, group) for a, d in zip(args, in_dims)] + list(args[len(in_dims):])
    out = fn(*args, **kwargs)
    if isinstance(out, (tuple, list)):
        return type(out)(keep_rows(o, d, group) for o, d in zip(out, out_dims))
    return keep_rows(out, out_dims[0] if out_dims else None, group)
