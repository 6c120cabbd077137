"""Memory per rank measured from live tensors (not estimated): bytes of parameters, gradients and
optimizer state after a training step, and the peak bytes autograd saves for backward during a
forward (``torch.autograd.graph.saved_tensors_hooks``). Each tensor is counted by the storage it keeps
alive, once (a parameter that is a view of a ZeRO bucket counts the bucket, padding included).

A whole-model case leaves its last step's measurement in the :class:`MemoryLog` its caller hands it;
the rank's answer carries it and the row's JSON holds one dict per rank."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass
class MemoryLog:
    """Where a whole-model case leaves the memory it measured on this rank (``last``: its last step's
    :func:`measure`, or None where it measured nothing)."""

    last: dict | None = None


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (``None`` skipped)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def optimizer_tensors(opt) -> list[torch.Tensor]:
    """Every state tensor of ``opt`` (a :class:`~nnscaler.runtime.zero.ZeroOptimizer`'s inner one)."""
    state = opt.optim.state if hasattr(opt, "optim") else opt.state
    return [v for st in state.values() for v in st.values() if isinstance(v, torch.Tensor)]


class SavedActivations:
    """Within the context, bytes of the distinct storages autograd saves for backward (parameters
    excluded: they are counted as parameters); all of them stay alive until backward, so the total at
    the end of a forward is its peak."""

    def __init__(self, params: Iterable[torch.Tensor]):
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._seen: set[int] = set()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in self._params and ptr not in self._seen:
            self._seen.add(ptr)
            self.bytes += s.nbytes()
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def measure(pm, opt, activations: int, grads: int) -> dict[str, int]:
    """This rank's bytes: parameters and optimizer state live now (after a step), gradients and saved
    activations as measured during the step."""
    params = pm.param_tensors() if hasattr(pm, "param_tensors") else pm.parameters()  # zero 3: the shards
    return {"params": storage_bytes(params), "grads": grads,
            "optimizer": storage_bytes(optimizer_tensors(opt)), "activations": activations}

