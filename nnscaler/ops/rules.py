"""Annotation rules: the annotation of an ATen call derived from its shapes and arguments.

A fixed registry entry (``register_op``) covers one pattern; a rule covers every call of an
overload whose annotation depends on the call (``view`` to any shape, ``add`` with any broadcast,
``sum`` over any dims). A rule returns an :class:`~nnscaler.ops.spec.OpSpec` for that one call,
whose ``fn`` is called as ``fn(*inputs, **kwargs)`` with one input per positional argument of the
call (tensors, or ``?`` values given in ``args``, possibly as ``Size`` expressions that follow the
local lengths under a partition), exactly like a fixed entry, so the harness can verify it too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch


@dataclass(frozen=True)
class TensorMeta:
    """A tensor argument of a call, by shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class OpCall:
    """One call of an ATen overload as a traced graph holds it: tensor arguments as
    :class:`TensorMeta` (lists of tensors as lists of them), everything else by value."""

    overload: str  # e.g. "aten.view.default"
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    outputs: tuple[Any, ...] = ()  # TensorMeta per output (None for a non-tensor output)

    def tensor(self, i: int) -> TensorMeta:
        a = self.args[i]
        if not isinstance(a, TensorMeta):
            raise TypeError(f"{self.overload}: argument {i} is not a tensor")
        return a


Rule = Callable[[OpCall], "OpSpec | None"]  # noqa: F821  (nnscaler.ops.spec.OpSpec)


def aten_overload(name: str):
    """``"aten.view.default"`` -> ``torch.ops.aten.view.default`` (KeyError naming it if absent)."""
    ns, op, overload = name.split(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (AttributeError, RuntimeError):
        raise KeyError(f"torch has no operator overload {name!r}") from None
