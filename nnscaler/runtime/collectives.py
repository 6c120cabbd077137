"""Collectives with autograd: the forward/backward pairs that move tensors between layouts.

Convention (Megatron's, generalised): a replicated tensor's gradient is the whole gradient on every
rank; a partial-value tensor's gradient is replicated. Each function below is one pair:

==================  =========================  ===========================
function            forward                    backward
==================  =========================  ===========================
``split``           R -> D: keep own chunk      all-gather the chunks
``all_gather``      D -> R                      keep own chunk
``all_reduce``      V -> R: sum                 identity
``reduce_scatter``  V -> D: sum, keep chunk     all-gather
``to_partial``      R -> V: rank 0 keeps it     identity
``grad_all_reduce`` R -> R, consumed split      all-reduce (sum partial grads)
``all_gather_sum_grad`` D -> R, consumed split  reduce-scatter (sum partial grads)
``all_to_all``      D(a) -> D(b)                D(b) -> D(a)
``all_to_all_v``    rows to the ranks of counts the rows back
``all_reduce_coalesced`` several V -> R: one sum  identity
==================  =========================  ===========================

A split in the balanced order of context parallelism (``D1z``, see
:class:`~nnscaler.dimops.layout.Shard`) is a plain split of the dim put in that order first:
``split(to_balanced(x))`` and ``from_balanced(all_gather(x))`` (a local permutation each way).

A ``group`` of ``None`` means a single rank: every function is then the identity.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..dimops.layout import balanced_order, join_blocks


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _gather(x: torch.Tensor, dim: int, group, blocks: int = 1) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return join_blocks(parts, dim, blocks)


def _piece(x: torch.Tensor, dim: int, n: int, blocks: int, r: int) -> torch.Tensor:
    """Rank ``r``'s chunk of ``x`` along ``dim`` among ``n`` (with ``blocks``, its chunk of every block:
    one factor of a fused dim)."""
    if x.shape[dim] % (n * blocks):
        raise ValueError(f"cannot split dim {dim} of length {x.shape[dim]} into {n} equal chunks of {blocks} blocks")
    if blocks > 1:
        return x.unflatten(dim, (blocks, -1)).chunk(n, dim=dim + 1)[r].flatten(dim, dim + 1).contiguous()
    return x.chunk(n, dim=dim)[r].contiguous()


def _chunk(x: torch.Tensor, dim: int, group, blocks: int = 1) -> torch.Tensor:
    return _piece(x, dim, _size(group), blocks, _rank(group))


def _sum(x: torch.Tensor, group) -> torch.Tensor:
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=group)
    return x


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, blocks):
        ctx.dim, ctx.group, ctx.blocks = dim, group, blocks
        return _chunk(x, dim, group, blocks)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.dim, ctx.group, ctx.blocks), None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, blocks):
        ctx.dim, ctx.group, ctx.blocks = dim, group, blocks
        return _gather(x, dim, group, blocks)

    @staticmethod
    def backward(ctx, g):
        return _chunk(g, ctx.dim, ctx.group, ctx.blocks), None, None, None


class _AllGatherSumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, blocks):
        ctx.dim, ctx.group, ctx.blocks = dim, group, blocks
        return _gather(x, dim, group, blocks)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.dim, ctx.group, ctx.blocks), None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _sum(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, blocks):
        ctx.dim, ctx.group, ctx.blocks = dim, group, blocks
        return _reduce_scatter(x, dim, group, blocks)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.dim, ctx.group, ctx.blocks), None, None, None


def _reduce_scatter(x: torch.Tensor, dim: int, group, blocks: int = 1) -> torch.Tensor:
    """Sum over ``group`` and keep this rank's chunk (of every block): rank ``r`` sends each peer the
    chunk that peer keeps, one path for every backend (:func:`reduce_scatter_parts`)."""
    n = _size(group)
    return reduce_scatter_parts([_piece(x, dim, n, blocks, r) for r in range(n)], group)


def reduce_scatter_parts(parts: list[torch.Tensor], group) -> torch.Tensor:
    """The sum over ``group`` of every rank's ``parts[my rank]``: ``dist.reduce_scatter`` where the backend
    has it; gloo has none, so the same exchange runs as one ``all_to_all_single`` and the sum is taken
    here (so the chunk order the nccl path relies on runs, and is tested, on CPU too)."""
    if dist.get_backend(group) != "gloo":
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=group)
        return out
    flat = torch.cat([p.reshape(-1) for p in parts])
    got = torch.empty_like(flat)
    dist.all_to_all_single(got, flat, group=group)
    return got.view(len(parts), *parts[0].shape).sum(0)


class _ToPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return x.clone() if _rank(group) == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _sum(g, ctx.group), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gather_dim, split_dim, group):
        ctx.dims, ctx.group = (gather_dim, split_dim), group
        return _chunk(_gather(x, gather_dim, group), split_dim, group)

    @staticmethod
    def backward(ctx, g):
        gather_dim, split_dim = ctx.dims
        return _chunk(_gather(g, split_dim, ctx.group), gather_dim, ctx.group), None, None, None


def _exchange_rows(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """``dist.all_to_all_single`` with split sizes (gloo has it on CPU, as nccl does on CUDA)."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.counts, ctx.group = (send, recv), group
        return _exchange_rows(x, send, recv, group)

    @staticmethod
    def backward(ctx, g):
        send, recv = ctx.counts
        return _exchange_rows(g, recv, send, ctx.group), None, None, None


def _differentiable(x: torch.Tensor) -> bool:
    return x.is_floating_point() or x.is_complex()


def split(x: torch.Tensor, dim: int, group, blocks: int = 1) -> torch.Tensor:
    """R -> D along ``dim`` (its chunk of each of ``blocks`` blocks); backward all-gathers."""
    if group is None:
        return x
    return _Split.apply(x, dim, group, blocks) if _differentiable(x) else _chunk(x, dim, group, blocks)


def all_gather(x: torch.Tensor, dim: int, group, blocks: int = 1) -> torch.Tensor:
    """D -> R along ``dim`` (pieces of ``blocks`` blocks interleaved back); backward keeps this
    rank's chunk."""
    if group is None:
        return x
    return _AllGather.apply(x, dim, group, blocks) if _differentiable(x) else _gather(x, dim, group, blocks)


def all_gather_sum_grad(x: torch.Tensor, dim: int, group, blocks: int = 1) -> torch.Tensor:
    """D -> R along ``dim`` for work split along this axis, whose gradients are partial sums:
    backward reduce-scatters them (``all_gather`` then ``grad_all_reduce`` in one collective each
    way, Megatron's sequence-parallel gather)."""
    if group is None:
        return x
    return _AllGatherSumGrad.apply(x, dim, group, blocks) if _differentiable(x) else _gather(x, dim, group, blocks)


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """V -> R (sum); backward is the identity."""
    if group is None:
        return x
    return _AllReduce.apply(x, group) if _differentiable(x) else _sum(x, group)


def _offsets(sizes: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each of ``sizes`` elements laid end to end in one flat buffer."""
    out, at = [], 0
    for n in sizes:
        out.append((at, at + n))
        at += n
    return out


def all_reduce_coalesced(xs: list[torch.Tensor], group) -> tuple[torch.Tensor, ...]:
    """:func:`all_reduce` of each of ``xs`` (independent partial values on one group), in one
    collective per dtype: flattened, concatenated, summed once, split back at each one's offsets
    and reshaped. Built of differentiable ops around :func:`all_reduce`: backward is the identity."""
    if group is None:
        return tuple(xs)
    out: list = [None] * len(xs)
    for dtype in dict.fromkeys(x.dtype for x in xs):  # one buffer per dtype (autocast may mix them)
        idx = [i for i, x in enumerate(xs) if x.dtype == dtype]
        flat = all_reduce(torch.cat([xs[i].reshape(-1) for i in idx]), group)
        for i, (a, b) in zip(idx, _offsets([xs[i].numel() for i in idx])):
            out[i] = flat[a:b].view(xs[i].shape)
    return tuple(out)


def reduce_scatter(x: torch.Tensor, dim: int, group, blocks: int = 1) -> torch.Tensor:
    """V -> D along ``dim`` (its chunk of each of ``blocks`` blocks); backward all-gathers."""
    if group is None:
        return x
    if _differentiable(x):
        return _ReduceScatter.apply(x, dim, group, blocks)
    return _chunk(_sum(x, group), dim, group, blocks)


def to_partial(x: torch.Tensor, group) -> torch.Tensor:
    """R -> V: the first rank of ``group`` keeps the value, the others hold zeros."""
    if group is None:
        return x
    return _ToPartial.apply(x, group)


def grad_all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward for a replicated tensor consumed by split work; backward sums the partial
    gradients over ``group`` (Megatron's ``f``)."""
    if group is None or not _differentiable(x):
        return x
    return _GradAllReduce.apply(x, group)


def all_to_all(x: torch.Tensor, gather_dim: int, split_dim: int, group) -> torch.Tensor:
    """D(gather_dim) -> D(split_dim); backward the reverse."""
    if group is None:
        return x
    if not _differentiable(x):
        return _chunk(_gather(x, gather_dim, group), split_dim, group)
    return _AllToAll.apply(x, gather_dim, split_dim, group)


def all_to_all_v(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Rows of ``x`` in rank order: the first ``send[0]`` go to rank 0 of ``group``, the next
    ``send[1]`` to rank 1, ...; returns the ``recv[j]`` rows from each rank ``j``, in rank order
    (expert parallelism's token dispatch). Backward sends the gradient rows back the same way."""
    if group is None:
        return x
    return _AllToAllV.apply(x, list(send), list(recv), group) if _differentiable(x) else \
        _exchange_rows(x, list(send), list(recv), group)


def _order(x: torch.Tensor, dim: int, group, blocks: int, inverse: bool) -> torch.Tensor:
    order = torch.tensor(balanced_order(x.shape[dim], _size(group), blocks), device=x.device)
    if inverse:
        order = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=x.device))
    return x.index_select(dim, order)


def to_balanced(x: torch.Tensor, dim: int, group, blocks: int = 1) -> torch.Tensor:
    """Put ``dim`` in the balanced order for ``group`` (its ``2n`` pieces of every block as
    ``0, 2n-1, 1, 2n-2, ...``), so a plain ``split`` or ``reduce_scatter`` hands rank ``r`` pieces ``r`` and
    ``2n-1-r``; differentiable (a local permutation)."""
    return x if group is None else _order(x, dim, group, blocks, False)


def from_balanced(x: torch.Tensor, dim: int, group, blocks: int = 1) -> torch.Tensor:
    """Inverse of :func:`to_balanced`: the ranks' balanced pieces, all-gathered, back in natural order."""
    return x if group is None else _order(x, dim, group, blocks, True)


def exchange_counts(send: torch.Tensor, group) -> torch.Tensor:
    """Each rank's ``send[j]`` (how many rows it sends rank ``j``) -> how many it receives from each."""
    if group is None:
        return send
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group)
    return recv
