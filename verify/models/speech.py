"""A tiny speech encoder-decoder (plain torch), the structure of transformers' Whisper: a ``Conv1d``
front end over mel features (a convolution, then a strided one, GELU after each), permuted to
``(batch, frames, width)`` and added to a frozen sinusoidal position table; pre-norm encoder layers
of self-attention and an MLP; a decoder of token and position embeddings, causal self-attention,
cross-attention to the encoder's output and an MLP; an LM head tied to the token embedding, trained
with cross entropy on the labels shifted right (as Whisper's ``shift_tokens_right``).

Attention is written as transformers' eager attention (``view -> transpose(1, 2)``, ``matmul`` with
``transpose(2, 3)``, softmax, ``matmul``, ``transpose(1, 2) -> reshape``), and keys and values pass
through a key/value cache as transformers' ``DynamicLayer.update`` does when ``use_cache`` is on:
``torch.cat([cached, new], dim=-2)`` with an empty cache made as ``torch.tensor([])`` (a 1-d empty
piece, which the ``cat`` rule does not annotate, so the ``cat`` stays an operator with no annotation
whose tensors are a *list* argument). The compiler once lost the tensors read only from such a list
(``IROp.tensor_inputs``), so every key and value after the cache was thought to carry no gradient
and the conversions to split attention left out the all-reduces summing their partial gradients
(``random`` plans: the first convolution's gradient off by 1e-4, a ``transpose`` named first)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from verify.models.registry import ModelCase, register_model, tokens


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's position table: sines then cosines of geometrically spaced timescales."""
    inc = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2))
    t = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)


class Cache:
    """One layer's keys and values, appended along the sequence (transformers' ``DynamicLayer``)."""

    def __init__(self):
        self.keys = self.values = None

    def update(self, k, v):
        if self.keys is None:  # lazy initialisation: 1-d empties of the keys' dtype
            self.keys = torch.tensor([], dtype=k.dtype, device=k.device)
            self.values = torch.tensor([], dtype=v.dtype, device=v.device)
        self.keys = torch.cat([self.keys, k], dim=-2)
        self.values = torch.cat([self.values, v], dim=-2)
        return self.keys, self.values


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, causal: bool = False):
        super().__init__()
        self.heads, self.hd, self.causal = heads, width // heads, causal
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width, bias=False)  # Whisper's key projection has no bias
        self.v = nn.Linear(width, width)
        self.o = nn.Linear(width, width)

    def forward(self, x, memory=None):
        b, t, _ = x.shape
        src = x if memory is None else memory
        q = (self.q(x) * self.hd ** -0.5).view(b, t, -1, self.hd).transpose(1, 2).contiguous()
        k = self.k(src).view(b, -1, self.heads, self.hd).transpose(1, 2).contiguous()
        v = self.v(src).view(b, -1, self.heads, self.hd).transpose(1, 2).contiguous()
        k, v = Cache().update(k, v)
        scores = torch.matmul(q, k.transpose(2, 3))
        if self.causal:
            mask = torch.ones(t, k.shape[2], dtype=torch.bool).tril()
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        out = torch.matmul(F.softmax(scores, dim=-1), v)
        return self.o(out.transpose(1, 2).contiguous().reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class EncoderLayer(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(width), Attention(width, heads)
        self.ln2, self.mlp = nn.LayerNorm(width), MLP(width)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class DecoderLayer(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1, self.self_attn = nn.LayerNorm(width), Attention(width, heads, causal=True)
        self.ln2, self.cross = nn.LayerNorm(width), Attention(width, heads)
        self.ln3, self.mlp = nn.LayerNorm(width), MLP(width)

    def forward(self, x, memory):
        x = x + self.self_attn(self.ln1(x))
        x = x + self.cross(self.ln2(x), memory)
        return x + self.mlp(self.ln3(x))


class SpeechEncoderDecoder(nn.Module):
    def __init__(self, mels: int = 8, frames: int = 16, width: int = 32, heads: int = 2, vocab: int = 53,
                 targets: int = 6, layers: int = 1):
        super().__init__()
        self.conv1 = nn.Conv1d(mels, width, 3, padding=1)
        self.conv2 = nn.Conv1d(width, width, 3, stride=2, padding=1)
        self.enc_pos = nn.Embedding(frames // 2, width)
        self.enc_pos.weight.data.copy_(sinusoids(frames // 2, width))
        self.enc_pos.requires_grad_(False)  # as Whisper: a frozen sinusoidal table
        self.encoder = nn.ModuleList([EncoderLayer(width, heads) for _ in range(layers)])
        self.enc_ln = nn.LayerNorm(width)
        self.embed = nn.Embedding(vocab, width)
        self.dec_pos = nn.Embedding(targets, width)
        self.decoder = nn.ModuleList([DecoderLayer(width, heads) for _ in range(layers)])
        self.dec_ln = nn.LayerNorm(width)
        self.start = 1

    def forward(self, features, labels):
        x = F.gelu(self.conv2(F.gelu(self.conv1(features)))).permute(0, 2, 1)
        x = x + self.enc_pos(torch.arange(self.enc_pos.num_embeddings))
        for layer in self.encoder:
            x = layer(x)
        memory = self.enc_ln(x)
        tokens = labels.new_zeros(labels.shape)  # shift_tokens_right
        tokens[:, 1:] = labels[:, :-1].clone()
        tokens[:, 0] = self.start
        y = self.embed(tokens) + self.dec_pos(torch.arange(labels.shape[1]))
        for layer in self.decoder:
            y = layer(y, memory)
        logits = F.linear(self.dec_ln(y), self.embed.weight)  # tied LM head
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


@register_model("speech_encdec", widenable=True)
def speech_encdec(seed: int, width: int = 32) -> ModelCase:
    """``speech_encdec@WIDTH``: 8 mel bins x 16 frames, heads of 16, 6 target tokens of 53."""
    torch.manual_seed(seed)
    model = SpeechEncoderDecoder(width=width, heads=max(1, width // 16))

    def batch(step: int):
        g = torch.Generator().manual_seed(7000 + 100 * seed + step)
        return torch.randn(4, 8, 16, generator=g), tokens(53, (4, 6), 7001 + 100 * seed + step)
    return ModelCase(model, batch)
