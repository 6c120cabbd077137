"""A tiny xLSTM-like language model (plain torch), the structure of transformers' ``xLSTMForCausalLM``
in its default (``"inference"``) mode: an embedding, pre-norm residual blocks of a matrix-memory
recurrence (mLSTM: q, k, v and gate projections split into heads, a stabilised exponential-gate
update of a ``dhqk x dhv`` memory per head, step by step) and a gated MLP, an output norm and an LM
head trained with cross entropy.

What it reproduces: the recurrence runs over the sequence in chunks; each chunk's steps are stacked
(``torch.stack``) and the chunks joined by ``torch.concatenate`` (``aten.concatenate``, an operator
with no annotation, whose tensors are a *list* argument), and every step casts its state and results
(``.to(dtype=...)``) as xLSTM does. The whole output of the recurrence, and so every gradient the
model's projections and embedding get, flows through that list: the compiler once lost the tensors
read only from a list argument (``IROp.tensor_inputs``), so the gradient of everything after the
``concatenate`` was thought to be none, and the conversions to operators split after it left out the
all-reduces that sum their partial gradients (``random`` plans: the embedding's gradient off by
percents). The state dtype follows the model's (xLSTM keeps a float32 state whatever the model's
dtype, which makes a float64 run of it no float64 program)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from verify.models.registry import ModelCase, register_model, tokens


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        in_dtype = x.dtype
        y = x.to(dtype=self.weight.dtype)  # xLSTM: x.float() for the reduction, then back
        y = y * torch.rsqrt(y.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return y.to(in_dtype) * self.weight


def _step(q, k, v, i, f, c, n, m, state_dtype):
    """One mLSTM step (``transformers``' ``mlstm_recurrent_step_native``): q, k ``b h dk``, v ``b h dv``,
    gates ``b h 1``; state c ``b h dk dv``, n ``b h dk``, m ``b h 1``."""
    qkv_dtype = q.dtype
    c, n, m = c.to(dtype=state_dtype), n.to(dtype=state_dtype), m.to(dtype=state_dtype)
    f_log = F.logsigmoid(f)
    m_new = torch.max(f_log + m, i)
    f_act = torch.exp(f_log + m - m_new)
    i_act = torch.exp(i - m_new)
    q = q * (q.shape[-1] ** -0.5)
    c_new = f_act[:, :, :, None] * c.clone() + i_act[:, :, :, None] * (k[:, :, :, None] @ v[:, :, None, :])
    n_new = f_act * n.clone() + i_act * k
    h_num = (q[:, :, None, :] @ c_new.to(dtype=qkv_dtype)).squeeze(2).to(dtype=state_dtype)
    qn = (q[:, :, None, :] @ n_new[:, :, :, None].to(dtype=qkv_dtype)).squeeze(2)
    h_den = (torch.maximum(qn.abs(), torch.exp(-m_new)) + 1e-6).to(dtype=state_dtype)
    h = (h_num / h_den).to(dtype=qkv_dtype)
    return h, c_new.to(dtype=state_dtype), n_new.to(dtype=state_dtype), m_new.to(dtype=state_dtype)


class MLSTMLayer(nn.Module):
    def __init__(self, width: int, heads: int, chunk: int):
        super().__init__()
        self.heads, self.chunk = heads, chunk
        self.q = nn.Linear(width, width // 2, bias=False)
        self.k = nn.Linear(width, width // 2, bias=False)
        self.v = nn.Linear(width, width, bias=False)
        self.ogate = nn.Linear(width, width, bias=False)
        self.igate = nn.Linear(width, heads)
        self.fgate = nn.Linear(width, heads)
        with torch.no_grad():  # xLSTM's gate init: input gates nearly shut, forget gates open
            self.igate.bias.fill_(-10.0)
            self.fgate.bias.copy_(torch.linspace(3.0, 6.0, heads))
        self.norm_weight = nn.Parameter(torch.ones(width))
        self.out = nn.Linear(width, width, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        heads = lambda t: t.reshape(b, s, self.heads, -1).transpose(1, 2)  # noqa: E731
        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        cap = lambda t: 15.0 * torch.tanh(t / 15.0)  # noqa: E731  (xLSTM's soft cap of the gates)
        i, f = cap(self.igate(x)).transpose(1, 2), cap(self.fgate(x)).transpose(1, 2)
        dk, dv = q.shape[-1], v.shape[-1]
        sd = self.norm_weight.dtype
        c = torch.zeros(b, self.heads, dk, dv, dtype=sd)
        n = torch.zeros(b, self.heads, dk, dtype=sd)
        m = torch.zeros(b, self.heads, 1, dtype=sd)
        chunks = []
        for start in range(0, s, self.chunk):
            hs = []
            for t in range(start, min(s, start + self.chunk)):
                h, c, n, m = _step(q[:, :, t, :], k[:, :, t, :], v[:, :, t, :], i[:, :, t, None], f[:, :, t, None],
                                   c, n, m, sd)
                hs.append(h)
            chunks.append(torch.stack(hs, dim=-2))
        h = torch.concatenate(chunks, dim=2).transpose(1, 2)  # b s heads dv
        in_dtype = h.dtype
        hf = h.to(dtype=sd)  # the multi-head layer norm's reduction in the state dtype, then back
        hf = (hf - hf.mean(dim=-1, keepdim=True)) * torch.rsqrt(hf.var(dim=-1, keepdim=True, unbiased=False) + 1e-6)
        h = hf.to(in_dtype).reshape(b, s, -1) * self.norm_weight
        return self.out(torch.sigmoid(self.ogate(x)) * h)


class Block(nn.Module):
    def __init__(self, width: int, heads: int, chunk: int):
        super().__init__()
        self.norm1, self.mlstm = RMSNorm(width), MLSTMLayer(width, heads, chunk)
        self.norm2 = RMSNorm(width)
        self.up_gate, self.up = nn.Linear(width, 2 * width, bias=False), nn.Linear(width, 2 * width, bias=False)
        self.down = nn.Linear(2 * width, width, bias=False)

    def forward(self, x):
        x = x + self.mlstm(self.norm1(x))
        y = self.norm2(x)
        return x + self.down(F.silu(self.up_gate(y)) * self.up(y))


class TinyXLSTM(nn.Module):
    def __init__(self, vocab: int = 61, width: int = 32, heads: int = 2, layers: int = 2, chunk: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([Block(width, heads, chunk) for _ in range(layers)])
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        logits = 30.0 * torch.tanh(logits / 30.0)  # xLSTM's output soft cap
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@register_model("xlstm_tiny", widenable=True)
def xlstm_tiny(seed: int, width: int = 32) -> ModelCase:
    """``xlstm_tiny@WIDTH``: 2 blocks of 2 heads, sequences of 4 in chunks of 2, vocabulary 61 (the
    recurrence unrolls into ~60 operators per step: sequences of 8 made it the sweep's costliest model,
    with nothing more to check)."""
    torch.manual_seed(seed)
    model = TinyXLSTM(width=width)
    return ModelCase(model, lambda step: (tokens(61, (4, 4), 300 + 2 * step + seed),
                                          tokens(61, (4, 4), 301 + 2 * step + seed)))
