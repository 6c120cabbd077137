"""Tiny ``transformers`` models built from a config (no download): Llama, GPT-2 and BERT, wrapped to
return their loss. Vocabulary sizes and one head count are deliberately not divisible by 2 or 4."""
from __future__ import annotations

import torch
import torch.nn as nn

from .builders import ModelCase, _tokens, register_model


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


def _causal_lm(model: nn.Module) -> nn.Module:
    """``model`` with its loss named: GPT-2's class name names none, and transformers warns on every
    first loss of a process (once per rank, per case) unless it is set."""
    model.loss_type = "ForCausalLM"
    return model


def _lm_batch(vocab: int, seed: int, masked: bool = False):
    def batch(step: int):
        ids = _tokens(vocab, (4, 8), 100 * seed + step)
        labels = ids.clone()
        if masked:  # predict every other position only
            labels[:, ::2] = -100
        return ids, labels
    return batch


@register_model("llama", widenable=True)
def llama(seed: int, width: int = 32) -> ModelCase:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=101, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                      num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager", use_cache=False)
    return ModelCase(LossOf(LlamaForCausalLM(cfg)), _lm_batch(101, seed))


@register_model("gpt2")
def gpt2(seed: int) -> ModelCase:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=99, n_embd=48, n_layer=2, n_head=3, n_positions=32, attn_pdrop=0.0, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_implementation="eager", use_cache=False,
                     bos_token_id=0, eos_token_id=0)  # inside the vocabulary: transformers warns otherwise
    return ModelCase(LossOf(_causal_lm(GPT2LMHeadModel(cfg))), _lm_batch(99, seed))


@register_model("bert")
def bert(seed: int) -> ModelCase:
    from transformers import BertConfig, BertForMaskedLM
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=103, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=32,
                     attn_implementation="eager")
    return ModelCase(MaskedLossOf(BertForMaskedLM(cfg)), _lm_batch(103, seed, masked=True))
