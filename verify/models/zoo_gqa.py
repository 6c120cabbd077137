"""Causal LMs of transformers' zoo with fewer key/value heads than ranks, each built from the generic
tiny config ``bench/studies/zoo_sweep.py`` uses (no per-model tuning): 4 query heads of 16 sharing 1
key/value head (multi-query) or 8 sharing 2 (grouped-query, fewer than 4 ranks). Not registered
(the built-in sweep stays as it is); the harness names them by file::

    python -m verify model verify/models/zoo_gqa.py:qwen2_mqa --policy tp --world-size 2
    python -m verify model verify/models/zoo_gqa.py:mistral_gqa --policy tp --world-size 4
"""
from __future__ import annotations

import torch

from verify.models.common import LossOf, causal_lm, lm_batch
from verify.models.registry import ModelCase

VOCAB = 101  # odd: the vocabulary-parallel embedding and loss split it unevenly


def zoo_case(arch: str, seed: int, heads: int, kv_heads: int) -> ModelCase:
    """``arch``'s tiny causal LM (``AutoConfig.for_model``) returning its loss, eager attention."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(arch, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
                               max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                               use_cache=False, tie_word_embeddings=False, attention_dropout=0.0,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_implementation="eager")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    return ModelCase(LossOf(causal_lm(model)), lm_batch(VOCAB, seed))


def qwen2_mqa(seed: int) -> ModelCase:
    return zoo_case("qwen2", seed, 4, 1)


def mistral_gqa(seed: int) -> ModelCase:
    return zoo_case("mistral", seed, 8, 2)


def gemma_mqa(seed: int) -> ModelCase:
    return zoo_case("gemma", seed, 4, 1)


def phi3_gqa(seed: int) -> ModelCase:
    return zoo_case("phi3", seed, 8, 2)


def starcoder2_gqa(seed: int) -> ModelCase:
    return zoo_case("starcoder2", seed, 8, 2)
