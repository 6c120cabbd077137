"""Tiny ``transformers`` Llama and Qwen3 whose head counts divide by 2 and 4, for transformers' own
tensor-parallel plan (``tp_plan="auto"`` shards q/k/v by heads: the registered ``llama`` and
``qwen3`` have 2 and 1 key/value heads, which 4 and 2 ranks cannot split). Vocabularies stay odd
(101, 103): the LM head's ``colwise_gather_output`` splits them unevenly. Not registered as models
(the compiler's sweep has its own); the torch-parallelization cases name them by file."""
from __future__ import annotations

import torch

from verify.models.common import LossOf, lm_batch
from verify.models.registry import ModelCase


def _decoder(config_cls, model_cls, vocab: int, seed: int) -> ModelCase:
    torch.manual_seed(seed)
    config = config_cls(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=8, max_position_embeddings=32,
                        attn_implementation="eager", use_cache=False)
    return ModelCase(LossOf(model_cls(config)), lm_batch(vocab, seed))


def llama(seed: int) -> ModelCase:
    from transformers import LlamaConfig, LlamaForCausalLM
    return _decoder(LlamaConfig, LlamaForCausalLM, 101, seed)


def qwen3(seed: int) -> ModelCase:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return _decoder(Qwen3Config, Qwen3ForCausalLM, 103, seed)
