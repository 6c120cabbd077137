"""More tiny ``transformers`` models built from configs (no download), wrapped to return their loss:
Mixtral (grouped and batched experts), Qwen3, Gemma, Phi-3, T5 with labels and ViT. Vocabulary
sizes and head counts are deliberately not divisible by 2 or 4.

Mixtral's experts run through ``config._experts_implementation``, which transformers resolves in
``PreTrainedModel.get_correct_experts_implementation``: ``"grouped_mm"`` (its default where
``torch._grouped_mm`` can dispatch: sorted tokens, ``histc`` offsets, one grouped matmul per
projection) or ``"batched_mm"`` (each token-expert pair gathers its expert's weights and runs a
``bmm``); ``"eager"`` loops over the experts hit, which ``torch.export`` cannot trace (a
data-dependent loop). Both traceable variants are registered: ``mixtral`` and ``mixtral_batched``.
``mixtral_ep`` runs its experts as :mod:`opzoo.experts`' one annotated operator (``"nnscaler_ep"``),
4 experts, which the planners split by expert with an all-to-all token dispatch (expert parallelism).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .builders import ModelCase, register_model
from .resnet_gn import image_batch
from . import hf  # (its names are read at call time: builders imports this module while hf may be half-loaded)

HEADS = dict(num_attention_heads=3, num_key_value_heads=1, head_dim=16)  # 3 query heads share one key head


def _decoder(cls_cfg, cls_model, vocab: int, seed: int, **cfg) -> ModelCase:
    torch.manual_seed(seed)
    config = cls_cfg(vocab_size=vocab, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                     max_position_embeddings=32, attn_implementation="eager", use_cache=False, **cfg)
    return ModelCase(hf.LossOf(cls_model(config)), hf._lm_batch(vocab, seed))


def _mixtral(seed: int, experts: str, num_experts: int = 3) -> ModelCase:
    import transformers.integrations.moe  # noqa: F401  (defines transformers::grouped_mm_fallback)
    from transformers import MixtralConfig, MixtralForCausalLM

    from opzoo.rules.moe import register_transformers_grouped_mm
    register_transformers_grouped_mm()
    if experts == "nnscaler_ep":
        from opzoo.experts import register_transformers
        register_transformers()
    return _decoder(MixtralConfig, MixtralForCausalLM, 97, seed, num_local_experts=num_experts, num_experts_per_tok=2,
                    experts_implementation=experts, router_jitter_noise=0.0, **HEADS)


@register_model("mixtral")
def mixtral(seed: int) -> ModelCase:
    """Mixtral with transformers' default experts (``torch._grouped_mm``)."""
    return _mixtral(seed, "grouped_mm")


@register_model("mixtral_batched")
def mixtral_batched(seed: int) -> ModelCase:
    """Mixtral with batched experts (per token-expert pair, a gathered weight and a ``bmm``)."""
    return _mixtral(seed, "batched_mm")


@register_model("mixtral_ep")
def mixtral_ep(seed: int) -> ModelCase:
    """Mixtral with 4 experts as one expert-parallel operator (``opzoo.experts``)."""
    return _mixtral(seed, "nnscaler_ep", num_experts=4)


@register_model("qwen3")
def qwen3(seed: int) -> ModelCase:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return _decoder(Qwen3Config, Qwen3ForCausalLM, 103, seed, **HEADS)


@register_model("gemma")
def gemma(seed: int) -> ModelCase:
    from transformers import GemmaConfig, GemmaForCausalLM
    return _decoder(GemmaConfig, GemmaForCausalLM, 99, seed, **HEADS)


@register_model("phi3")
def phi3(seed: int) -> ModelCase:
    from transformers import Phi3Config, Phi3ForCausalLM
    return _decoder(Phi3Config, Phi3ForCausalLM, 101, seed, num_attention_heads=3, num_key_value_heads=3,
                    resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0, bos_token_id=1,
                    eos_token_id=2)  # inside the vocabulary: transformers warns otherwise


@register_model("t5")
def t5(seed: int) -> ModelCase:
    """Encoder-decoder T5; the decoder's inputs are the labels shifted right (transformers does it)."""
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=101, d_model=48, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=3,
                   relative_attention_num_buckets=8, dropout_rate=0.0, use_cache=False, pad_token_id=0,
                   decoder_start_token_id=0, eos_token_id=1, attn_implementation="eager")
    return ModelCase(hf.LossOf(T5ForConditionalGeneration(cfg)), hf._lm_batch(101, seed))


class ClassifierLoss(nn.Module):
    """``model(pixel_values=..., labels=...).loss`` as a module of two tensors."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values, labels):
        return self.model(pixel_values=pixel_values, labels=labels).loss


@register_model("vit")
def vit(seed: int) -> ModelCase:
    from transformers import ViTConfig, ViTForImageClassification
    torch.manual_seed(seed)
    cfg = ViTConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=64, image_size=8,
                    patch_size=4, num_channels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                    num_labels=5, attn_implementation="eager")
    return ModelCase(ClassifierLoss(ViTForImageClassification(cfg)), image_batch(5, seed))
