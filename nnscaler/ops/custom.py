"""A registered Python function or ``torch.autograd.Function`` as a ``torch.library.custom_op``, so
``torch.export`` keeps it as one node (partitioned by its annotation) instead of inlining it.

The schema comes from the annotation (a tensor per named input, a typed value per ``?``), the fake
implementation is the function itself run on fake tensors, and the backward recomputes the function
under autograd (through the ``Function``'s own ``backward`` for a ``Function``): nothing of what the
user wrote is replaced by a guess."""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import torch

NAMESPACE = "nnscaler_user"
_TYPES = ((bool, "bool"), (int, "SymInt"), (float, "float"), (str, "str"))


def _opaque_type(value: Any, pos: int, name: str) -> str:
    from .spec import Size
    if isinstance(value, Size) or (isinstance(value, (list, tuple)) and value and isinstance(value[0], Size)):
        return "SymInt[]"
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return "SymInt[]"
    for py, ty in _TYPES:
        if isinstance(value, py):
            return ty
    raise ValueError(f"register_op({name}): cannot type its '?' argument {pos} for torch.library.custom_op; give it "
                     f"a value in args={{{pos}: ...}} (int, float, bool, str, a list of ints or Size)")


def schema(anno, args: Mapping[int, Any], name: str) -> str:
    """``(Tensor x0, SymInt[] x1) -> Tensor`` from a parsed annotation."""
    params = [f"{'Tensor' if not t.opaque else _opaque_type(args.get(i), i, name)} x{i}" for i, t in enumerate(anno.inputs)]
    outs = ["Tensor"] * len(anno.outputs)
    return f"({', '.join(params)}) -> {outs[0] if len(outs) == 1 else '(' + ', '.join(outs) + ')'}"


def _fresh(out):
    """Outputs as new tensors (a custom op may not return a view of its input)."""
    if isinstance(out, (tuple, list)):
        return tuple(o.clone() for o in out)
    return out.clone()


def make_custom_op(fn: Callable, anno, args: Mapping[int, Any], name: str):
    """The custom op ``nnscaler_user::<name>`` computing ``fn``; returns the ``CustomOpDef``."""
    qual = f"{NAMESPACE}::{re.sub(r'[^0-9A-Za-z_]', '_', name)}"
    op = torch.library.custom_op(qual, mutates_args=(), schema=schema(anno, args, name))(
        lambda *a: _fresh(_no_grad(fn, a)))
    op.register_fake(lambda *a: _fresh(fn(*a)))

    def setup(ctx, inputs, output):
        ctx.inputs = inputs

    def backward(ctx, *grads):
        with torch.enable_grad():
            xs = [x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
                  for x in ctx.inputs]
            outs = fn(*xs)
            outs = outs if isinstance(outs, (tuple, list)) else (outs,)
            wanted = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            got = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True) \
                if pairs and wanted else [None] * len(wanted)
        it = iter(got)
        return tuple(next(it) if isinstance(x, torch.Tensor) and x.requires_grad else None for x in xs)

    op.register_autograd(backward, setup_context=setup)
    return op


def _no_grad(fn, a):
    with torch.no_grad():
        return fn(*a)


def is_plain_function(fn: Any) -> bool:
    """A user's Python function (not torch's, not already a custom op or an ATen overload)."""
    import inspect
    return inspect.isfunction(fn) and not str(getattr(fn, "__module__", "")).startswith(("torch", "opzoo"))


def is_autograd_function(fn: Any) -> bool:
    return isinstance(fn, type) and issubclass(fn, torch.autograd.Function)
