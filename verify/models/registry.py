"""The registry of whole models the harness verifies: :class:`ModelCase` (a model that returns its loss
and the batch of each step), the builders by name, and :func:`register_model`. The catalogue of
built-in models (``verify.models``' modules) registers itself here when the package is imported."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn


@dataclass
class ModelCase:
    model: nn.Module
    batch: Callable[[int], tuple]  # step -> sample arguments
    bucket_bytes: int | None = None  # compile with gradient-sync buckets this small (None: the default)
    loss_count: Callable[..., object] | None = None  # batch args -> how many elements the loss averages
    # (None: a fixed number per row); micro-batched steps weigh each micro-batch's mean loss by it


def tokens(vocab: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


MODELS: dict[str, Callable[[int], ModelCase]] = {}
"""Model builders by name; ``register_model`` adds a user's (``--module`` files are imported first)."""

WIDENABLE: dict[str, Callable[[int, int], ModelCase]] = {}
"""Builders that take a width: ``NAME@WIDTH`` (e.g. ``nanogpt@128``) builds that model at that width."""


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
