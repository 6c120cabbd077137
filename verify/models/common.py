"""Wrappers that make a library model return its loss, and the token batches of language models."""
from __future__ import annotations

import torch.nn as nn

from verify.models.registry import tokens


class LossOf(nn.Module):
    """``model(input_ids=..., labels=...).loss`` as a module of two tensors."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


class MaskedLossOf(LossOf):
    def forward(self, input_ids, labels):  # BERT has no cache
        return self.model(input_ids=input_ids, labels=labels).loss


def causal_lm(model: nn.Module) -> nn.Module:
    """``model`` with its loss named: GPT-2's class name names none, and transformers warns on every
    first loss of a process (once per rank, per case) unless it is set."""
    model.loss_type = "ForCausalLM"
    return model


def lm_batch(vocab: int, seed: int, masked: bool = False):
    def batch(step: int):
        ids = tokens(vocab, (4, 8), 100 * seed + step)
        labels = ids.clone()
        if masked:  # predict every other position only
            labels[:, ::2] = -100
        return ids, labels
    return batch
