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
    """A floating or boolean tensor computed whole without gradient (rotary tables, a causal mask) is
    cut to chunk 0 on every rank: each rank's tokens take the first chunk's positions (token ids,
    integers, are still split right)."""
    C = _C()
    orig = C.split

    def split(x, dim, group, blocks=1):
        if group is None or x.requires_grad or not (x.is_floating_point() or x.dtype == torch.bool):
            return orig(x, dim, group, blocks)
        return C._piece(x, dim, C._size(group), blocks, 0)

    patch(C, "split", split)


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
