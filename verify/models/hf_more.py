"""More tiny ``transformers`` models built from configs (no download), wrapped to return their loss:
Mixtral (grouped and batched experts), Qwen3, Gemma, Phi-3, T5 with labels and ViT. Vocabulary
sizes and head counts are deliberately not divisible by 2 or 4.

Mixtral's experts run through ``config._experts_implementation``, which transformers resolves in
``PreTrainedModel.get_correct_experts_implementation``: ``"grouped_mm"`` (its default where
``torch._grouped_mm`` can dispatch: sorted tokens, ``histc`` offsets, one grouped matmul per
projection) or ``"batched_mm"`` (each token-expert pair gathers its expert's weights and runs a
``bmm``); ``"eager"`` loops over the experts hit, which ``torch.export`` cannot trace (a
data-dependent loop). Both traceable variants are registered: ``mixtral`` and ``mixtral_batched``.
``mixtral_ep`` runs its experts as :mod:`opzoo.moe.experts`' one annotated operator (``"nnscaler_ep"``),
4 experts, which the planners split by expert with an all-to-all token dispatch (expert parallelism).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from verify.models.common import LossOf, causal_lm, lm_batch
from verify.models.registry import ModelCase, register_model
from verify.models.resnet_gn import image_batch

WIDTH = 48  # the default hidden size; ``NAME@WIDTH`` changes it (heads of 16: ``width // 16`` of them)


def heads(width: int) -> dict:
    """``width // 16`` query heads of 16 (3 at the default width) sharing one key/value head."""
    return dict(num_attention_heads=max(1, width // 16), num_key_value_heads=1, head_dim=16)


def _decoder(cls_cfg, cls_model, vocab: int, seed: int, width: int = WIDTH, **cfg) -> ModelCase:
    torch.manual_seed(seed)
    cfg = {**heads(width), **cfg}
    config = cls_cfg(vocab_size=vocab, hidden_size=width, intermediate_size=4 * width // 3, num_hidden_layers=2,
                     max_position_embeddings=32, attn_implementation="eager", use_cache=False, **cfg)
    return ModelCase(LossOf(cls_model(config)), lm_batch(vocab, seed))


def _mixtral(seed: int, experts: str, num_experts: int = 3, width: int = WIDTH) -> ModelCase:
    import transformers.integrations.moe  # noqa: F401  (defines transformers::grouped_mm_fallback)
    from transformers import MixtralConfig, MixtralForCausalLM

    from opzoo.moe.rules import register_transformers_grouped_mm
    register_transformers_grouped_mm()
    if experts == "nnscaler_ep":
        from opzoo.moe.experts import register_transformers
        register_transformers()
    return _decoder(MixtralConfig, MixtralForCausalLM, 97, seed, width, num_local_experts=num_experts,
                    num_experts_per_tok=2, experts_implementation=experts, router_jitter_noise=0.0)


@register_model("mixtral", widenable=True)
def mixtral(seed: int, width: int = WIDTH) -> ModelCase:
    """Mixtral with transformers' default experts (``torch._grouped_mm``)."""
    return _mixtral(seed, "grouped_mm", width=width)


@register_model("mixtral_batched", widenable=True)
def mixtral_batched(seed: int, width: int = WIDTH) -> ModelCase:
    """Mixtral with batched experts (per token-expert pair, a gathered weight and a ``bmm``)."""
    return _mixtral(seed, "batched_mm", width=width)


@register_model("mixtral_ep", widenable=True)
def mixtral_ep(seed: int, width: int = WIDTH) -> ModelCase:
    """Mixtral with 4 experts as one expert-parallel operator (``opzoo.moe.experts``)."""
    return _mixtral(seed, "nnscaler_ep", num_experts=4, width=width)


@register_model("qwen3", widenable=True)
def qwen3(seed: int, width: int = WIDTH) -> ModelCase:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return _decoder(Qwen3Config, Qwen3ForCausalLM, 103, seed, width)


@register_model("gemma", widenable=True)
def gemma(seed: int, width: int = WIDTH) -> ModelCase:
    from transformers import GemmaConfig, GemmaForCausalLM
    return _decoder(GemmaConfig, GemmaForCausalLM, 99, seed, width)


@register_model("phi3", widenable=True)
def phi3(seed: int, width: int = WIDTH) -> ModelCase:
    from transformers import Phi3Config, Phi3ForCausalLM
    n = max(1, width // 16)
    return _decoder(Phi3Config, Phi3ForCausalLM, 101, seed, width, num_attention_heads=n, num_key_value_heads=n,
                    resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0, bos_token_id=1,
                    eos_token_id=2)  # inside the vocabulary: transformers warns otherwise


@register_model("t5", widenable=True)
def t5(seed: int, width: int = WIDTH) -> ModelCase:
    """Encoder-decoder T5; the decoder's inputs are the labels shifted right (transformers does it)."""
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=101, d_model=width, d_kv=16, d_ff=4 * width // 3, num_layers=2, num_decoder_layers=2,
                   num_heads=max(1, width // 16),
                   relative_attention_num_buckets=8, dropout_rate=0.0, use_cache=False, pad_token_id=0,
                   decoder_start_token_id=0, eos_token_id=1, attn_implementation="eager")
    return ModelCase(LossOf(T5ForConditionalGeneration(cfg)), lm_batch(101, seed))


class ClassifierLoss(nn.Module):
    """``model(pixel_values=..., labels=...).loss`` as a module of two tensors."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values, labels):
        return self.model(pixel_values=pixel_values, labels=labels).loss


@register_model("vit", widenable=True)
def vit(seed: int, width: int = WIDTH) -> ModelCase:
    from transformers import ViTConfig, ViTForImageClassification
    torch.manual_seed(seed)
    cfg = ViTConfig(hidden_size=width, num_hidden_layers=2, num_attention_heads=max(1, width // 16),
                    intermediate_size=4 * width // 3, image_size=8,
                    patch_size=4, num_channels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                    num_labels=5, attn_implementation="eager")
    return ModelCase(ClassifierLoss(ViTForImageClassification(cfg)), image_batch(5, seed))
