"""The runtime side of activation recompute: the ``checkpoint`` the generated programs call (torch's
``torch.utils.checkpoint.checkpoint``, non-reentrant) and :class:`SavedActivations`, which measures
the bytes a forward pass keeps for backward (``torch.autograd.graph.saved_tensors_hooks``).

A checkpointed region keeps only its inputs (held by the checkpoint, not through the saved-tensor
hooks), so :func:`checkpoint` reports them to any :class:`SavedActivations` measuring; the tensors the
region saves go to the checkpoint's own hooks (innermost) and are dropped, then recomputed in backward.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.utils.checkpoint

_MEASURING: list["SavedActivations"] = []


def checkpoint(fn: Callable[..., Any], *args: Any, use_reentrant: bool = False) -> Any:
    """``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)`` (the region's inputs are
    what it keeps: counted by any :class:`SavedActivations` open)."""
    if torch.is_grad_enabled():
        for m in _MEASURING:
            for a in args:
                if isinstance(a, torch.Tensor):
                    m.add(a)
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=use_reentrant)


class SavedActivations:
    """``with SavedActivations(model.parameters()) as s: loss = model(x)``; then ``s.bytes``: the bytes of
    the distinct storages autograd keeps for backward (parameters and buffers left out), i.e. the saved
    activations at their peak, the end of forward (recompute adds one region's worth transiently during
    backward, not counted)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def add(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        if s.data_ptr() not in self._exclude:
            self._storages[s.data_ptr()] = s.nbytes()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())

    def __enter__(self) -> "SavedActivations":
        self._hooks.__enter__()
        _MEASURING.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _MEASURING.remove(self)
        self._hooks.__exit__(*exc)
