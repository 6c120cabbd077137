"""Mutants of gradient accumulation (micro-batches, ``ParallelModule.train_step``)."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ._base import _GS, mutant, patch


def _MB():
    from nnscaler.runtime import microbatch
    return microbatch


@mutant
def grad_sync_before_the_last_micro_batch():
    """``no_sync`` does nothing, and a gradient already holding its group's sum is not divided back
    before the next backward: every micro-batch's backward syncs, and the next sums synced gradients
    again (the reducer launched before the last micro-batch counts the earlier ones once per rank)."""
    @contextmanager
    def paused(self):
        yield
    patch(_GS().GradSync, "paused", paused)
    patch(_GS().GradSync, "_unsum", lambda self, p, b: None)


@mutant
def loss_scaled_per_micro_batch():
    """Each micro-batch's loss is its own mean and the batch's the mean of those: right only when every
    micro-batch averages as many elements (not with unevenly padded targets)."""
    MB = _MB()
    terms = MB.loss_terms

    def per_micro_batch(loss, rows):
        total, count = terms(loss, rows)
        return total / count.to(total.dtype), torch.ones((), dtype=torch.float64)
    patch(MB, "loss_terms", per_micro_batch)
