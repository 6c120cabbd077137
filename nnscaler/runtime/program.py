"""Helpers generated programs import."""
from __future__ import annotations

import torch

from ..ops.registry import DEFAULT_REGISTRY
from ..ops.spec import OpSpec


def registered(name: str) -> OpSpec:
    """A registered operator whose function has no importable name (a lambda, say)."""
    return DEFAULT_REGISTRY.get(name)


def write_buffer(buffer: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``value`` into this rank's piece of a buffer, in place and outside autograd: what the
    model's forward wrote into it (``self.ema.mul_(0.5).add_(...)``), carried out by the program."""
    with torch.no_grad():
        buffer.copy_(value)
