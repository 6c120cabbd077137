"""Whole models for end-to-end verification: each builder returns a model that returns its loss,
and a function giving the sample batch of a step (same on every rank, seeded)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .nanogpt import GPT, GPTConfig


@dataclass
class ModelCase:
    model: nn.Module
    batch: Callable[[int], tuple]  # step -> sample arguments


def _tokens(vocab: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def nanogpt(seed: int) -> ModelCase:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    return ModelCase(GPT(cfg), lambda step: (_tokens(64, (4, 8), 2 * step + seed), _tokens(64, (4, 8), 2 * step + 1 + seed)))


class EncoderRegression(nn.Module):
    """``torch.nn.TransformerEncoder`` (dropout 0) with a mean-squared-error loss."""

    def __init__(self, width: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, x, y):
        return F.mse_loss(self.encoder(x), y)


def transformer_encoder(seed: int) -> ModelCase:
    torch.manual_seed(seed)

    def batch(step: int):
        g = torch.Generator().manual_seed(1000 + step + seed)
        return torch.randn(4, 8, 32, generator=g), torch.randn(4, 8, 32, generator=g)

    return ModelCase(EncoderRegression(), batch)


MODELS: dict[str, Callable[[int], ModelCase]] = {"nanogpt": nanogpt, "transformer_encoder": transformer_encoder}
"""Model builders by name; ``register_model`` adds a user's (``--module`` files are imported first)."""


def register_model(name: str) -> Callable[[Callable[[int], ModelCase]], Callable[[int], ModelCase]]:
    """Decorator: make ``builder(seed) -> ModelCase`` verifiable as ``python -m verify model NAME``."""
    def deco(builder):
        MODELS[name] = builder
        return builder
    return deco


def _load_optional() -> None:
    """The plain-torch ResNet, and the ``transformers`` models where that package is installed."""
    from . import resnet_gn  # noqa: F401
    try:
        import transformers  # noqa: F401
    except ImportError:
        return
    from . import hf, hf_more  # noqa: F401  (register llama, gpt2, bert; mixtral, qwen3, gemma, phi3, t5, vit)


_load_optional()
