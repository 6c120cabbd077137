"""Mutants of context parallelism's ring scheme (``cp_ring``, ``cp_ring_balanced``, ``cp_tp_ring``): the ring
attention kernel of :mod:`nnscaler.runtime.ring` (keys and values travel rank to rank, blocks merged by online
softmax, masks read at the keys' global positions, key/value gradients sent back to their owners)."""
from __future__ import annotations

import torch

from ._base import mutant, patch


def _R():
    from nnscaler.runtime import ring
    return ring


@mutant
def ring_kv_gradient_not_returned():
    """The keys' and values' gradients travel the ring with them but the last send, the one that ends at
    their owner, is forgotten: each rank keeps the gradients of the next rank's keys."""
    R = _R()
    orig = R.pass_grads
    patch(R, "pass_grads", lambda ring, grads, step: grads if step == ring.size - 1 else orig(ring, grads, step))


@mutant
def ring_mask_ignores_chunk_offset():
    """Each block reads the mask's key columns at 0..L-1, as if the keys it holds were the first chunk:
    the block's mask ignores the chunk's global offset."""
    R = _R()
    patch(R, "_cols", lambda mask, start, length: mask if mask.shape[-1] == 1 else mask[..., :length])


@mutant
def ring_merge_wrong_weights():
    """The online softmax adds each block's ``exp(s - max) v`` to the running output without rescaling that
    output to the new maximum (the running sum is rescaled): the log-sum-exp merge weighs blocks wrong."""
    R = _R()

    def merge(m, l, acc, s, v):
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        shift = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        p, alpha = torch.exp(s - shift), torch.exp(m - shift)
        return m_new, l * alpha + p.sum(-1, keepdim=True), acc + p @ v

    patch(R, "merge", merge)
