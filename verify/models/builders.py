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
    bucket_bytes: int | None = None  # compile with gradient-sync buckets this small (None: the default)
    loss_count: Callable[..., object] | None = None  # batch args -> how many elements the loss averages
    # (None: a fixed number per row); micro-batched steps weigh each micro-batch's mean loss by it


def _tokens(vocab: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def nanogpt(seed: int, width: int = 32) -> ModelCase:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=width)
    return ModelCase(GPT(cfg), lambda step: (_tokens(64, (4, 8), 2 * step + seed), _tokens(64, (4, 8), 2 * step + 1 + seed)))


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


def bucketed_mlp(seed: int, width: int = 32) -> ModelCase:
    """A model whose synced gradients span many buckets (512 bytes each, so every weight is one or
    more buckets of its own and small parameters share one)."""
    torch.manual_seed(seed)
    return ModelCase(DeepMLP(width), _regression_batch(width, seed), bucket_bytes=512)


def weightnorm_mlp(seed: int, width: int = 32) -> ModelCase:
    """The same model, one block, default buckets: under ``tp`` its gain is synced over the tp axis."""
    torch.manual_seed(seed)
    return ModelCase(DeepMLP(width, blocks=1), _regression_batch(width, seed))


def gpt2_v96(seed: int, width: int = 48) -> ModelCase:
    """Tiny GPT-2 from ``transformers`` (as ``hf.gpt2``) with a vocabulary of 96, divisible by the
    degree, so vocabulary-parallel embedding and loss split it without padding."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from .hf import LossOf, _causal_lm, _lm_batch
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=96, n_embd=width, n_layer=2, n_head=3, n_positions=32, attn_pdrop=0.0,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_implementation="eager", use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    return ModelCase(LossOf(_causal_lm(GPT2LMHeadModel(cfg))), _lm_batch(96, seed))


MODELS: dict[str, Callable[[int], ModelCase]] = {
    "nanogpt": nanogpt, "transformer_encoder": transformer_encoder, "padded_gpt": padded_gpt,
    "bucketed_mlp": bucketed_mlp, "weightnorm_mlp": weightnorm_mlp}
"""Model builders by name; ``register_model`` adds a user's (``--module`` files are imported first)."""

WIDENABLE: dict[str, Callable[[int, int], ModelCase]] = {
    "nanogpt": nanogpt, "transformer_encoder": transformer_encoder, "padded_gpt": padded_gpt,
    "bucketed_mlp": bucketed_mlp, "weightnorm_mlp": weightnorm_mlp, "gpt2_v96": gpt2_v96}
"""Builders that take a width: ``NAME@WIDTH`` (e.g. ``nanogpt@128``) builds that model at that width."""


def known_model(name: str) -> bool:
    """Whether :func:`build_model` knows ``name`` (a registered model or ``NAME@WIDTH``)."""
    base, _, width = name.partition("@")
    return name in MODELS or (base in WIDENABLE and width.isdigit() and int(width) > 0)


def build_model(name: str, seed: int) -> ModelCase:
    """The case of model ``name`` (see :data:`MODELS` and :data:`WIDENABLE`, or ``FILE.py:builder``)
    for ``seed``."""
    from .loader import find_builder, is_file_reference  # the loader imports this module
    if is_file_reference(name):
        return find_builder(name)(seed)
    if name in MODELS:
        return MODELS[name](seed)
    base, _, width = name.partition("@")
    if not known_model(name):
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}, or NAME@WIDTH for "
                       f"{', '.join(sorted(WIDENABLE))}")
    return WIDENABLE[base](seed, int(width))


def register_model(name: str, widenable: bool = False) -> Callable[[Callable[[int], ModelCase]], Callable[[int], ModelCase]]:
    """Decorator: make ``builder(seed) -> ModelCase`` verifiable as ``python -m verify model NAME``;
    with ``widenable`` the builder is ``builder(seed, width=DEFAULT)`` and ``NAME@WIDTH`` builds it at
    that width too."""
    def deco(builder):
        MODELS[name] = builder
        if widenable:
            WIDENABLE[name] = builder
        return builder
    return deco


def _load_optional() -> None:
    """The plain-torch ResNet and 1-D conv net, and the ``transformers`` models where that package is installed."""
    from . import conv1d, recurrent, resnet_gn, speech  # noqa: F401
    try:
        import transformers  # noqa: F401
    except ImportError:
        return
    from . import hf, hf_more  # noqa: F401  (register llama, gpt2, bert; mixtral, qwen3, gemma, phi3, t5, vit)
    MODELS["gpt2_v96"] = gpt2_v96


_load_optional()
