"""A tiny CLIP-style contrastive model (plain torch): an image tower (a patch embedding by a strided
``Conv2d``, a pre-norm transformer layer, mean pooling) and a text tower (token and position
embeddings, a pre-norm transformer layer, the last token's state), each projected without bias into a
shared space and L2-normalised; the loss couples the whole batch: the ``B x B`` similarity matrix
scaled by ``exp(logit_scale)`` (a learned scalar, initialised to ``log(1 / 0.07)`` as CLIP does),
cross entropy of every image against every text and back, averaged.

Every element of the batch meets every other in the similarity matrix, so the scalar gradient of
``logit_scale`` is a sum over all ``B x B`` pairs (and their softmaxes): a long reduction whose
rounding grows with the batch, which a parallel program splitting the batch computes in another order.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from verify.models.registry import ModelCase, register_model, tokens


class Layer(nn.Module):
    """A pre-norm transformer layer: self-attention (``scaled_dot_product_attention``) and a GELU MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(width), nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.ln2, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x, causal: bool = False):
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(w, dim=-1)
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, w))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class ContrastiveModel(nn.Module):
    def __init__(self, width: int = 32, embed: int = 16, heads: int = 2, vocab: int = 40, length: int = 6,
                 channels: int = 3, image: int = 8, patch: int = 4):
        super().__init__()
        self.patches = nn.Conv2d(channels, width, patch, stride=patch)
        self.img_pos = nn.Parameter(torch.randn((image // patch) ** 2, width) * 0.02)
        self.img_layer, self.img_ln = Layer(width, heads), nn.LayerNorm(width)
        self.img_proj = nn.Linear(width, embed, bias=False)
        self.tok = nn.Embedding(vocab, width)
        self.txt_pos = nn.Parameter(torch.randn(length, width) * 0.01)
        self.txt_layer, self.txt_ln = Layer(width, heads), nn.LayerNorm(width)
        self.txt_proj = nn.Linear(width, embed, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, images, text):
        x = self.patches(images).flatten(2).transpose(1, 2) + self.img_pos
        img = self.img_proj(self.img_ln(self.img_layer(x)).mean(dim=1))
        y = self.txt_layer(self.tok(text) + self.txt_pos, causal=True)
        txt = self.txt_proj(self.txt_ln(y)[:, -1])
        img, txt = F.normalize(img, dim=-1), F.normalize(txt, dim=-1)
        logits = self.logit_scale.exp() * img @ txt.t()
        labels = torch.arange(logits.shape[0])
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


@register_model("clip_tiny", widenable=True)
def clip_tiny(seed: int, width: int = 32) -> ModelCase:
    """``clip_tiny@WIDTH``: batches of 8 image-text pairs (3 x 8 x 8 images in 4 patches, 6 tokens of 40)."""
    torch.manual_seed(seed)
    model = ContrastiveModel(width=width, heads=max(1, width // 16))

    def batch(step: int):
        g = torch.Generator().manual_seed(8000 + 100 * seed + step)
        return torch.randn(8, 3, 8, 8, generator=g), tokens(40, (8, 6), 8001 + 100 * seed + step)
    return ModelCase(model, batch)
