"""Mutants of context parallelism (the ``cp`` and ``cp_tp`` policies): the exchanges and the positions of a split
sequence. ``cp`` all-gathers keys and values before attention (``all_gather_sum_grad``: backward
reduce-scatters their gradients back to the owners) and slices the rotary tables and the causal mask,
computed whole from global positions, to the rank's chunk (``split`` of a tensor without gradient)."""
from __future__ import annotations

import torch

from ._base import _C, mutant, patch


@mutant
def cp_kv_gradient_not_reduced():
    """Keys/values all-gathered for attention hand back only this rank's slice of their gradient:
    the other ranks' queries' contributions to a key's gradient are never summed to its owner."""
    C = _C()
    patch(C._AllGatherSumGrad, "backward", staticmethod(
        lambda ctx, g: (C._chunk(g, ctx.dim, ctx.group, ctx.blocks), None, None, None)))


@mutant
def cp_positions_not_shifted():
    """A floating or boolean tensor computed whole without gradient (rotary tables, a causal mask), or the
    positions they are built from per chunk, is cut to chunk 0 on every rank: each rank's tokens take the
    first chunk's positions (token ids, integers of the batch's shape, are still split right)."""
    C = _C()
    orig = C.split

    def split(x, dim, group, blocks=1):
        if group is None or not _whole_no_grad(x):
            return orig(x, dim, group, blocks)
        return C._piece(x, dim, C._size(group), blocks, 0)

    patch(C, "split", split)


def _positions(x: torch.Tensor) -> bool:
    """Positions the program made itself (``arange``, ``position_ids``: integers of one dim or (1, seq); token ids
    and positions read from a sample batch of several rows are (batch, seq)): masks and rotary tables are built
    per chunk from them (:mod:`nnscaler.policies.masks`)."""
    return (x.dim() == 1 or (x.dim() == 2 and x.shape[0] == 1)) and not x.is_floating_point() and x.dtype != torch.bool


def _whole_no_grad(x: torch.Tensor) -> bool:
    """A tensor the program computed whole from positions alone: rotary tables, masks, the positions themselves
    (token ids and positions read from the batch are integers of two dims)."""
    return not x.requires_grad and (x.is_floating_point() or x.dtype == torch.bool or _positions(x))


@mutant
def cp_balanced_positions_contiguous():
    """``cp_balanced``: rotary tables and masks computed whole are cut in contiguous chunks while the
    tokens are in the balanced order (rank r: chunks r and 2W-1-r): the chunk order of the positions
    ignores the balanced layout."""
    C = _C()
    orig = C.to_balanced
    patch(C, "to_balanced", lambda x, dim, group, blocks=1: x if _whole_no_grad(x) else orig(x, dim, group, blocks))


@mutant
def cp_window_mask_not_shifted():
    """``cp_balanced``: a boolean mask computed whole (sliding window, causal), or the positions a mask is
    built from per chunk, gives every chunk the rows of the first chunk, as if each chunk's queries sat at
    positions 0..L-1: the window is not shifted per chunk."""
    C = _C()
    orig = C.to_balanced

    def to_balanced(x, dim, group, blocks=1):
        if not (x.dtype == torch.bool or _positions(x)) or group is None:
            return orig(x, dim, group, blocks)
        piece = x.shape[dim] // (2 * C._size(group) * blocks)
        return x.index_select(dim, torch.arange(x.shape[dim], device=x.device) % piece)

    patch(C, "to_balanced", to_balanced)


@mutant
def cp_balanced_keys_out_of_order():
    """``cp_balanced``: keys and values all-gathered from balanced pieces are left in the ranks' order
    (0, 2W-1, 1, 2W-2, ...) instead of put back in sequence order: the scores' key columns no
    longer line up with the mask's and the rotary positions'."""
    C = _C()
    patch(C, "from_balanced", lambda x, dim, group, blocks=1: x)


@mutant
def cp_tp_kv_gradient_wrong_axis():
    """Under ``cp_tp`` (cp x tp), keys/values all-gathered on one mesh axis sum their gradients over the
    next axis (``(a + 1) % axes``: tp for the cp axis) before keeping this rank's chunk: the other cp
    ranks' queries' contributions never reach a key's owner, and the tp ranks' different heads are added
    together. On a one-axis mesh the next axis is the same one (the mutant is then the right program)."""
    from nnscaler.comm.conversion import Step
    orig = Step.code

    def code(self, x: str, group: str) -> str:
        if self.kind != "all_gather_sum_grad" or not (group.startswith("g[") and group.endswith("]")):
            return orig(self, x, group)
        a = group[2:-1]
        wrong = f"g[({a} + 1) % len(g)]"
        gathered = Step(self.axis, "all_gather", self.dims, self.blocks)
        return orig(gathered, f"C.grad_all_reduce({x}, {wrong})", group)

    patch(Step, "code", code)


@mutant
def cp_tp_balanced_order_ignored():
    """``cp_tp_balanced`` (cp x tp): on the cp axis of a mesh of several axes (a group smaller than the world),
    tensors are cut in contiguous chunks, ignoring the balanced chunk order (rank r: chunks r and 2W-1-r),
    while keys and values gathered from them are still put back as if balanced: the keys' order and the
    tokens' positions no longer agree. On a one-axis mesh (``cp_balanced``) the mutant is the right program."""
    import torch.distributed as dist
    C = _C()
    orig = C.to_balanced

    def to_balanced(x, dim, group, blocks=1):
        if group is not None and C._size(group) < dist.get_world_size():
            return x
        return orig(x, dim, group, blocks)

    patch(C, "to_balanced", to_balanced)


@mutant
def ulysses_all_to_all_wrong_group():
    """``cp_tp_ulysses``: the all-to-all between sequence and heads runs over the group of the mesh axis below
    the one it converts (tp's, where cp is the innermost axis) instead of its own: each rank swaps its
    sequence chunk for heads with the ranks holding the other heads, not the other chunks."""
    from nnscaler.comm import conversion
    orig = conversion.Step.code

    def code(self, x: str, group: str) -> str:
        if self.kind == "all_to_all" and self.axis > 0 and group == f"g[{self.axis}]":
            group = f"g[{self.axis - 1}]"
        return orig(self, x, group)

    patch(conversion.Step, "code", code)
