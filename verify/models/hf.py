"""Tiny ``transformers`` models built from a config (no download): Llama, GPT-2 and BERT, wrapped to
return their loss. Vocabulary sizes and one head count are deliberately not divisible by 2 or 4."""
from __future__ import annotations

import torch
import torch.nn as nn

from verify.models.common import LossOf, MaskedLossOf, causal_lm, lm_batch
from verify.models.registry import ModelCase, register_model


@register_model("llama", widenable=True)
def llama(seed: int, width: int = 32) -> ModelCase:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=101, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                      num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager", use_cache=False)
    return ModelCase(LossOf(LlamaForCausalLM(cfg)), lm_batch(101, seed))


@register_model("gpt2")
def gpt2(seed: int) -> ModelCase:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=99, n_embd=48, n_layer=2, n_head=3, n_positions=32, attn_pdrop=0.0, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_implementation="eager", use_cache=False,
                     bos_token_id=0, eos_token_id=0)  # inside the vocabulary: transformers warns otherwise
    return ModelCase(LossOf(causal_lm(GPT2LMHeadModel(cfg))), lm_batch(99, seed))


@register_model("bert")
def bert(seed: int) -> ModelCase:
    from transformers import BertConfig, BertForMaskedLM
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=103, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=32,
                     attn_implementation="eager")
    return ModelCase(MaskedLossOf(BertForMaskedLM(cfg)), lm_batch(103, seed, masked=True))


@register_model("gpt2_v96", widenable=True)
def gpt2_v96(seed: int, width: int = 48) -> ModelCase:
    """Tiny GPT-2 from ``transformers`` (as ``hf.gpt2``) with a vocabulary of 96, divisible by the
    degree, so vocabulary-parallel embedding and loss split it without padding."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=96, n_embd=width, n_layer=2, n_head=3, n_positions=32, attn_pdrop=0.0,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_implementation="eager", use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    return ModelCase(LossOf(causal_lm(GPT2LMHeadModel(cfg))), lm_batch(96, seed))
