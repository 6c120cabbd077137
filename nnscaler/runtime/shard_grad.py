"""The ``.grad`` of a parameter whose gradient ZeRO 2/3 reduce-scattered: a placeholder, not ``None``.

Under ``zero >= 2`` a parameter's synced gradient exists only as slices of this rank's gradient
shard (:mod:`.zero`); left ``None``, ``.grad`` reads as "no gradient" and a hand
``torch.nn.utils.clip_grad_norm_(module.parameters(), ...)`` filters every such parameter out, finds a
norm of 0 and clips nothing: silently wrong. So after each backward the parameter's ``.grad`` is a
:class:`ShardGrad`: a tensor of the parameter's shape, dtype and device holding no storage, that
- scales this rank's slices of the gradient in the shard on ``mul_`` (what ``clip_grad_norm_`` does with
  the clip coefficient, once torch's norm of the module's whole gradient list is the model's norm:
  :mod:`.clip`), so clipping by hand is right;
- refuses every other operation with one line naming the built-in way (a norm of some of the
  parameters, an optimizer by hand, reading values: ``module.whole_grads()``).
It is dropped before a backward accumulates into ``.grad`` again, and by ``zero_grad``. A wrapper
subclass (``__torch_dispatch__``) rather than a hook on torch's functions, so nothing outside the
module's own gradients changes.
"""
from __future__ import annotations

from typing import Callable

import torch


class ShardGradError(ValueError):
    """A reduce-scattered gradient used as if it were whole."""


class ShardGrad(torch.Tensor):
    """The placeholder ``.grad`` of a parameter (module docstring); ``pieces()`` gives this rank's
    slices of its gradient (views into the shard's gradient)."""

    @staticmethod
    def __new__(cls, param: torch.Tensor, pieces: Callable[[], list[torch.Tensor]], stage: int):
        self = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device)
        self.pieces, self.stage = pieces, stage
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:  # printing would read values
        return f"ShardGrad(shape={tuple(self.shape)}, zero={self.stage}: reduce-scattered into the gradient shard)"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        me = args[0] if args else None
        if func in (torch.ops.aten.mul_.Tensor, torch.ops.aten.mul_.Scalar) and isinstance(me, ShardGrad) \
                and not any(isinstance(a, ShardGrad) for a in args[1:]):
            with torch.no_grad():
                for piece in me.pieces():
                    piece.mul_(args[1])
            return me
        stage = next(a.stage for a in args if isinstance(a, ShardGrad)) if any(isinstance(a, ShardGrad) for a in args) \
            else 2
        raise ShardGradError(
            f"{func}: the gradient of a parameter of a module compiled with zero={stage} lives in this rank's "
            f"gradient shard, not in .grad; clip with torch.nn.utils.clip_grad_norm_(module.parameters(), ...) over "
            f"all of them, module.clip_grad_norm_(max_norm) or ComputeConfig(clip_grad_norm=...), step with "
            f"module.build_optimizer(...), read it whole with module.whole_grads()")


def is_placeholder(g) -> bool:
    return isinstance(g, ShardGrad)


def real(g: torch.Tensor | None) -> torch.Tensor | None:
    """``g`` unless it is a placeholder (then ``None``: no gradient in ``.grad``)."""
    return None if isinstance(g, ShardGrad) else g
