"""Small plain-torch models for end-to-end verification (nanoGPT, the TransformerEncoder, and coverage
models): each builder returns a model that returns its loss, and a function giving the sample batch of
a step (same on every rank, seeded)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from verify.models.nanogpt import GPT, GPTConfig
from verify.models.registry import ModelCase, register_model, tokens


@register_model('nanogpt', widenable=True)
def nanogpt(seed: int, width: int = 32) -> ModelCase:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=width)
    return ModelCase(GPT(cfg), lambda step: (tokens(64, (4, 8), 2 * step + seed), tokens(64, (4, 8), 2 * step + 1 + seed)))


@register_model('padded_gpt', widenable=True)
def padded_gpt(seed: int, width: int = 32) -> ModelCase:
    """nanoGPT whose targets are padded (``ignore_index``) at the end of the batch, unevenly: the last
    rows hold fewer real targets, so a loss mean that is right only for balanced shards fails."""
    case = nanogpt(seed, width)

    def batch(step: int):
        idx, targets = case.batch(step)
        targets = targets.clone()
        targets[-1, 2:] = -100
        targets[-2, 5 + step % 2:] = -100
        return idx, targets

    return ModelCase(case.model, batch, loss_count=lambda idx, targets: (targets != -100).sum())


class EncoderRegression(nn.Module):
    """``torch.nn.TransformerEncoder`` (dropout 0) with a mean-squared-error loss."""

    def __init__(self, width: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, x, y):
        return F.mse_loss(self.encoder(x), y)


@register_model('transformer_encoder', widenable=True)
def transformer_encoder(seed: int, width: int = 32) -> ModelCase:
    torch.manual_seed(seed)

    def batch(step: int):
        g = torch.Generator().manual_seed(1000 + step + seed)
        return torch.randn(4, 8, width, generator=g), torch.randn(4, 8, width, generator=g)

    return ModelCase(EncoderRegression(width), batch)


class NormedBlock(nn.Module):
    """LayerNorm, a column projection, GELU, a learned scalar gain on the hidden units, a row projection.
    Under tensor parallelism the hidden units are split, so the gain, held whole, gets a partial
    gradient on each rank of the tensor-parallel axis and is synced over that axis."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.gain = nn.Parameter(torch.full((), 1.5))
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(self.gain * F.gelu(self.up(self.norm(x))))


class DeepMLP(nn.Module):
    """Residual blocks (:class:`NormedBlock`) and a weight-normalised linear head (norm over the whole
    weight), with a mean-squared-error loss."""

    def __init__(self, width: int = 32, blocks: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(NormedBlock(width) for _ in range(blocks))
        self.head = nn.utils.parametrizations.weight_norm(nn.Linear(width, width), dim=None)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x), y)


def _regression_batch(width: int, seed: int):
    def batch(step: int):
        g = torch.Generator().manual_seed(2000 + step + 7 * seed)
        return torch.randn(8, 4, width, generator=g), torch.randn(8, 4, width, generator=g)
    return batch


@register_model('bucketed_mlp', widenable=True)
def bucketed_mlp(seed: int, width: int = 32) -> ModelCase:
    """A model whose synced gradients span many buckets (512 bytes each, so every weight is one or
    more buckets of its own and small parameters share one)."""
    torch.manual_seed(seed)
    return ModelCase(DeepMLP(width), _regression_batch(width, seed), bucket_bytes=512)


@register_model('weightnorm_mlp', widenable=True)
def weightnorm_mlp(seed: int, width: int = 32) -> ModelCase:
    """The same model, one block, default buckets: under ``tp`` its gain is synced over the tp axis."""
    torch.manual_seed(seed)
    return ModelCase(DeepMLP(width, blocks=1), _regression_batch(width, seed))
