"""Rules for the functionalized in-place writes ``torch.export`` records for ``x[..., 1:] = y`` and
``x[..., 0] = v`` (T5's ``_shift_right``, any ``copy_``/``fill_`` into a slice):

* ``slice_scatter``/``select_scatter``: the written dim is frozen (in ``self``, in ``src`` and in
  the result: which rows land where depends on the whole dim); every other dim is shared by
  ``self``, ``src`` and the result and stays spatial, so the write follows its input's layout on
  the dims it does not index (``a n^, a m^, ?, ?, ?, ? -> a n^``);
* ``copy`` (``self.copy_(src)`` run out of place) and ``fill`` are element-wise (``a b, b, ? -> a b``,
  ``a b, 1 -> a b``), run as :func:`copy` and :func:`fill`: ATen's functional ``copy`` has no
  derivative, and ``fill.Tensor`` wants a 0-d value where a sampled one may be ``(1,)``.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from nnscaler.ops import OpCall, annotation_rule

from ..elementwise.rules import pointwise
from ..rulekit import Names, arg, build, frozen_dim, norm_dim, usable

FAMILY = "shape"


@annotation_rule("aten.slice_scatter.default")
def slice_scatter_rule(call: OpCall):
    """``a n^, a m^, ?, ?, ?, ? -> a n^``: ``src`` written into a slice of ``self`` along ``dim``."""
    if not usable(call):
        return None
    x, src = call.tensor(0), call.tensor(1)
    dim = norm_dim(arg(call, 2, "dim", 0), x.ndim)
    if src.ndim != x.ndim or any(a != b for d, (a, b) in enumerate(zip(x.shape, src.shape)) if d != dim):
        return None
    names, sizes = Names(), {}
    dx = [names.dim(n) for n in x.shape]
    ds = list(dx)
    dx[dim] = frozen_dim(names, x.shape[dim], sizes)
    ds[dim] = frozen_dim(names, src.shape[dim], sizes) if src.shape[dim] != x.shape[dim] else dx[dim]
    return build(call, FAMILY, {0: dx, 1: ds}, [dx], sizes=sizes)


@annotation_rule("aten.select_scatter.default")
def select_scatter_rule(call: OpCall):
    """``a n^ b, a b, ?, ? -> a n^ b``: ``src`` written at one index of ``self`` along ``dim``."""
    if not usable(call):
        return None
    x, src = call.tensor(0), call.tensor(1)
    dim = norm_dim(call.args[2], x.ndim)
    if tuple(src.shape) != tuple(x.shape[:dim] + x.shape[dim + 1:]):
        return None
    names, sizes = Names(), {}
    dx = [names.dim(n) for n in x.shape]
    dx[dim] = frozen_dim(names, x.shape[dim], sizes)
    return build(call, FAMILY, {0: dx, 1: dx[:dim] + dx[dim + 1:]}, [dx], sizes=sizes)


def copy(x: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``x.copy_(src)`` out of place: ``src`` cast to ``x``'s dtype and broadcast to its shape
    (differentiable in ``src``; ``x`` only gives the shape and dtype)."""
    return src.to(x.dtype).expand(x.shape).clone()


def fill(x: torch.Tensor, value) -> torch.Tensor:
    """``x.fill_(value)`` out of place (a one-element tensor or a number; differentiable in it)."""
    if isinstance(value, torch.Tensor):
        return value.reshape(()).to(x.dtype).expand(x.shape).clone()
    return torch.full_like(x, value)


@annotation_rule("aten.copy.default")
def copy_rule(call: OpCall):
    """``a b, b, ? -> a b``, run as :func:`copy`."""
    spec = pointwise(call)
    if spec is None or tuple(call.tensor(0).shape) != tuple(call.outputs[0].shape):
        return None
    return replace(spec, fn=copy)


@annotation_rule("aten.fill.Tensor", "aten.fill.Scalar")
def fill_rule(call: OpCall):
    """``a b, 1 -> a b`` (``fill.Tensor``) or ``a b, ? -> a b``, run as :func:`fill` (a number
    value: nothing to differentiate)."""
    spec = pointwise(call)
    if spec is None:
        return None
    tensor_value = len(call.args) > 1 and not isinstance(call.args[1], (int, float, bool))
    return replace(spec, fn=fill, differentiable=tensor_value and call.outputs[0].dtype.is_floating_point)
