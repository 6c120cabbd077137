"""Copies of a user's model without copying the object: each is built afresh from the model's builder
and takes the original's state. A model may hold what ``copy.deepcopy`` or pickle cannot take (a
``torch.library`` op handle, a lock, a file, hooks, compiled submodules); the harness never copies one."""
from __future__ import annotations

import torch

from verify.models.loader import build_model
from verify.judge.dtypes import to_dtype


def load_like(dst: torch.nn.Module, src: torch.nn.Module) -> torch.nn.Module:
    """``dst`` takes ``src``'s parameters and buffers (cast to ``dst``'s dtypes) and training mode; its
    gradients are cleared."""
    with torch.no_grad():
        dst.load_state_dict(src.state_dict(), strict=True)
    dst.zero_grad(set_to_none=True)
    dst.train(src.training)
    return dst


def built_like(name: str, seed: int, like: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Model ``name`` built afresh for ``seed``, in ``dtype``, holding ``like``'s state."""
    model = build_model(name, seed).model
    if dtype is not None:
        model = to_dtype(model, dtype)
    return load_like(model, like)
