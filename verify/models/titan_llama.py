"""A tiny Llama written as torchtitan writes it (``wq``/``wk``/``wv``/``wo`` attention with rotary
embeddings and grouped KV heads, ``w1``/``w2``/``w3`` SwiGLU feed-forward, ``attention_norm`` and
``ffn_norm`` RMSNorms, ``tok_embeddings``, ``norm``, ``output``), so torchtitan's tensor-parallel
plan applies to it name for name (:mod:`verify.models.torch_plans`). Its forward reshapes heads with
``-1`` (local heads under tensor parallelism) and returns the mean cross-entropy of its tokens.

``titan_llama_complex`` keeps the rotary cache as torchtitan does, a complex buffer (``torch.polar``)
applied by complex multiplication; ``titan_llama`` is its real-arithmetic twin (same parameters and
numbers, cos and sin as a real buffer).

The vocabulary (101) is deliberately not divisible by 2 or 4: DTensor shards it unevenly."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from verify.models.registry import ModelCase, tokens

VOCAB, DIM, HEADS, KV_HEADS, LAYERS, SEQ, BATCH = 101, 64, 8, 4, 2, 8, 4  # heads divide by 4 ranks


def rotary(head_dim: int, seq: int) -> torch.Tensor:
    """cos and sin of the rotary angles, ``(seq, head_dim // 2, 2)`` (a buffer: real, so DTensor and
    float64 references take it as they take any tensor)."""
    freqs = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def rotary_complex(head_dim: int, seq: int) -> torch.Tensor:
    """torchtitan's ``precompute_freqs_cis``: ``exp(i * angle)``, complex64 ``(seq, head_dim // 2)``."""
    rope = rotary(head_dim, seq)
    return torch.polar(torch.ones_like(rope[..., 0]), torch.atan2(rope[..., 1], rope[..., 0]))


def apply_rotary_complex(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``apply_rotary_emb``: ``x`` viewed as complex pairs (in float32), times the cache."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3)
    return out.type_as(x)


def apply_rotary(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """``x`` (batch, seq, heads, head_dim) rotated pairwise by ``rope`` (seq, head_dim // 2, 2)."""
    xr = x.reshape(*x.shape[:-1], -1, 2)
    cos, sin = rope[: x.shape[1], None, :, 0].to(x.dtype), rope[: x.shape[1], None, :, 1].to(x.dtype)
    a, b = xr[..., 0], xr[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim, self.n_rep = dim // heads, heads // kv_heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[:2]
        q = self.wq(x).view(b, s, -1, self.head_dim)  # -1: the heads this rank holds
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        rotate = apply_rotary_complex if rope.is_complex() else apply_rotary
        q, k = rotate(q, rope), rotate(k, rope)
        k, v = k.repeat_interleave(self.n_rep, dim=2), v.repeat_interleave(self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.attention = Attention(dim, heads, kv_heads)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.feed_forward = FeedForward(dim, 2 * dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The language model: token ids -> logits (no loss; :class:`TitanLM` adds it)."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, heads: int = HEADS, kv_heads: int = KV_HEADS,
                 layers: int = LAYERS, seq: int = SEQ, complex_rope: bool = False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads, kv_heads) for i in range(layers)})
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)
        cache = rotary_complex if complex_rope else rotary
        self.register_buffer("rope", cache(dim // heads, seq), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(ids)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        return self.output(self.norm(h))


class CrossEntropy(nn.Module):
    """The mean cross-entropy of logits against labels, a module of its own so that a plan (and a
    localisation) can name it."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


class TitanLM(nn.Module):
    """``Transformer`` plus its loss: ``(ids, labels) -> mean cross-entropy``."""

    def __init__(self, vocab: int = VOCAB, **kw):
        super().__init__()
        self.model = Transformer(vocab, **kw)
        self.loss = CrossEntropy()

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(self.model(ids), labels)


def lm_batches(vocab: int, seed: int):
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = tokens(vocab, (BATCH, SEQ + 1), 100 * seed + step)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return batch


def titan_llama(seed: int, vocab: int = VOCAB) -> ModelCase:
    """The torchtitan-style Llama at its default sizes (vocabulary 101)."""
    torch.manual_seed(seed)
    return ModelCase(TitanLM(vocab), lm_batches(vocab, seed))


def titan_llama_v96(seed: int) -> ModelCase:
    """The same with a vocabulary of 96, divisible by the tensor-parallel degree."""
    return titan_llama(seed, 96)


def titan_llama_complex(seed: int) -> ModelCase:
    """The same with torchtitan's complex rotary cache (a complex64 buffer made by ``torch.polar``)."""
    torch.manual_seed(seed)
    return ModelCase(TitanLM(VOCAB, complex_rope=True), lm_batches(VOCAB, seed))
