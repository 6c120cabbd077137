"""Mutants of the differentiable collectives (``nnscaler/runtime/collectives.py``)."""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from ._base import _C, mutant, patch


@mutant
def all_reduce_missing():
    patch(_C(), "all_reduce", lambda x, group: x)


@mutant
def all_reduce_averages():
    C = _C()
    orig = C._sum
    patch(C, "_sum", lambda x, group: orig(x, group) / C._size(group))


@mutant
def all_gather_reversed_chunks():
    C = _C()

    def gather(x, dim, group, blocks=1):
        parts = [torch.empty_like(x) for _ in range(C._size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return C.join_blocks(parts[::-1], dim, blocks)
    patch(C, "_gather", gather)


@mutant
def split_off_by_one_chunk():
    C = _C()

    orig = C._chunk

    def chunk(x, dim, group, blocks=1):
        if blocks > 1:
            return orig(x, dim, group, blocks)
        n = C._size(group)
        return x.chunk(n, dim=dim)[(C._rank(group) + 1) % n].contiguous()
    patch(C, "_chunk", chunk)


@mutant
def split_backward_scaled():
    C = _C()
    patch(C._Split, "backward", staticmethod(
        lambda ctx, g: (C._gather(g, ctx.dim, ctx.group, ctx.blocks) * C._size(ctx.group), None, None, None)))


@mutant
def all_gather_backward_sums():
    C = _C()
    patch(C._AllGather, "backward", staticmethod(
        lambda ctx, g: (C._chunk(C._sum(g, ctx.group), ctx.dim, ctx.group, ctx.blocks), None, None, None)))


@mutant
def all_reduce_backward_sums():
    """The all-reduce's backward sums the (already whole) gradient over the group again."""
    C = _C()

    def forward(ctx, x, group):
        ctx.group = group  # the real forward keeps no group: its backward needs none
        return C._sum(x, group)
    patch(C._AllReduce, "forward", staticmethod(forward))
    patch(C._AllReduce, "backward", staticmethod(lambda ctx, g: (C._sum(g, ctx.group), None)))


@mutant
def grad_all_reduce_backward_missing():
    patch(_C()._GradAllReduce, "backward", staticmethod(lambda ctx, g: (g, None)))


@mutant
def grad_all_reduce_backward_averages():
    C = _C()
    patch(C._GradAllReduce, "backward", staticmethod(lambda ctx, g: (C._sum(g, ctx.group) / C._size(ctx.group), None)))


@mutant
def to_partial_on_every_rank():
    patch(_C()._ToPartial, "forward", staticmethod(lambda ctx, x, group: x.clone()))


@mutant
def reduce_scatter_skips_the_sum():
    C = _C()
    def forward(ctx, x, dim, group, blocks):
        ctx.dim, ctx.group, ctx.blocks = dim, group, blocks
        return C._chunk(x, dim, group, blocks)
    patch(C._ReduceScatter, "forward", staticmethod(forward))


@mutant
def all_to_all_backward_wrong_dims():
    C = _C()

    def backward(ctx, g):
        gather_dim, split_dim = ctx.dims
        return C._chunk(C._gather(g, gather_dim, ctx.group), split_dim, ctx.group), None, None, None
    patch(C._AllToAll, "backward", staticmethod(backward))


@mutant
def collectives_on_the_world_group():
    C = _C()
    for name in ("all_reduce", "grad_all_reduce", "to_partial"):
        orig = getattr(C, name)
        patch(C, name, lambda x, group, _o=orig: _o(x, None if group is None else dist.group.WORLD))


@mutant
def all_gather_on_one_rank_only():
    C = _C()
    orig = C.all_gather
    patch(C, "all_gather", lambda x, dim, group, blocks=1: x.repeat_interleave(C._size(group), dim)
          if group is not None and C._rank(group) == 0 and x.is_floating_point() else orig(x, dim, group, blocks))


@mutant
def grad_all_reduce_forward_sums():
    C = _C()

    def forward(ctx, x, group):
        ctx.group = group
        return C._sum(x, group)
    patch(C._GradAllReduce, "forward", staticmethod(forward))


@mutant
def all_to_all_reversed_chunks():
    C = _C()

    def forward(ctx, x, gather_dim, split_dim, group):
        ctx.dims, ctx.group = (gather_dim, split_dim), group
        parts = [torch.empty_like(x) for _ in range(C._size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return C._chunk(torch.cat(parts[::-1], dim=gather_dim), split_dim, group)
    patch(C._AllToAll, "forward", staticmethod(forward))


@mutant
def all_gather_sum_grad_backward_unsummed():
    C = _C()
    patch(C._AllGatherSumGrad, "backward", staticmethod(
        lambda ctx, g: (C._chunk(g, ctx.dim, ctx.group, ctx.blocks), None, None, None)))


@mutant
def split_ignores_blocks():
    """A split of one factor of a fused dim (``D1/3``) takes a contiguous chunk instead."""
    C = _C()
    orig = C._chunk
    patch(C, "_chunk", lambda x, dim, group, blocks=1: orig(x, dim, group, 1))


@mutant
def all_reduce_coalesced_wrong_offsets():
    """The coalesced all-reduce cuts the flat sum back as if the tensors were laid end to end in reverse
    order: each member gets another's statistics (where sizes are equal) or a misaligned slice."""
    C = _C()

    def offsets(sizes):
        ends = list(itertools.accumulate(reversed(sizes)))[::-1]
        return [(end - n, end) for n, end in zip(sizes, ends)]
    patch(C, "_offsets", offsets)
