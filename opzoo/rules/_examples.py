"""Verified examples of the rules: each example call's derived spec is registered in the zoo (family
``rules``, name ``rule.<op>.<i>``, e.g. ``rule.view.0``, ``rule.add.Tensor.2``), so ``python -m
verify all`` checks the rules' annotations on real ranks, at the harness's own lengths.

``T(2, 8, 32)`` is a tensor argument by shape; ``ex(*args, **kwargs)`` one call. An example's
outputs are found by running the op on zeros, as a traced graph would record them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch

from nnscaler.dimops.binding import bind
from nnscaler.ops import DEFAULT_REGISTRY, OpCall, OpRegistry, OpSpec, TensorMeta, aten_overload
from nnscaler.trace.calls import flatten_tensor_lists

from ._common import short_name

FAMILY = "rules"
EXAMPLES: dict[str, list[str]] = {}  # overload -> names of its registered examples


def T(*shape: int, dtype: torch.dtype = torch.float32) -> TensorMeta:
    return TensorMeta(tuple(shape), dtype)


@dataclasses.dataclass(frozen=True)
class ex:  # noqa: N801  (reads as a call in example lists)
    """One example call: positional and keyword arguments, tensors as :func:`T`."""

    args: tuple
    kwargs: dict

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "kwargs", kwargs)


def _real(value: Any) -> Any:
    if isinstance(value, TensorMeta):
        return torch.zeros(value.shape, dtype=value.dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_real(v) for v in value)
    return value


def _meta(value: Any) -> Any:
    return TensorMeta(tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else None


def make_call(overload: str, args: tuple, kwargs: dict | None = None) -> OpCall:
    """The :class:`OpCall` of running ``overload`` on zeros of these shapes."""
    kwargs = dict(kwargs or {})
    out = aten_overload(overload)(*_real(args), **kwargs)
    outs = tuple(_meta(o) for o in out) if isinstance(out, (list, tuple)) else (_meta(out),)
    return OpCall(overload, tuple(args), kwargs, outs)


def derive(call: OpCall, registry: OpRegistry | None = None) -> OpSpec | None:
    """The spec of the first rule of ``call.overload`` that annotates ``call`` (``None`` if none)."""
    for rule in (registry or DEFAULT_REGISTRY).rules(call.overload):
        spec = rule(call)
        if spec is not None:
            return spec
    return None


def shapes_of(call: OpCall) -> tuple[list, list]:
    """Input shapes (lists of tensors flattened in place, as the compiler does; ``None`` for
    non-tensors) and output shapes: what a derived annotation must bind."""
    ins = [a.shape if isinstance(a, TensorMeta) else None for a in flatten_tensor_lists(call.args)]
    outs = [m.shape if isinstance(m, TensorMeta) else None for m in call.outputs]
    return ins, (None if None in outs else outs)  # None: an op returning nothing


def register_examples(overload: str, calls: Iterable[ex | tuple]) -> list[str]:
    """Derive each example's spec with the registered rules and add it to the default registry.

    Raises if no rule annotates an example or its annotation does not bind to the example's shapes
    (a broken rule fails at import, not in the middle of a sweep)."""
    names = EXAMPLES.setdefault(overload, [])
    for c in calls:
        c = c if isinstance(c, ex) else ex(*c)
        call = make_call(overload, c.args, c.kwargs)
        spec = derive(call)
        if spec is None:
            raise ValueError(f"no rule annotates the example {call}")
        bind(spec.anno, *shapes_of(call), known=dict(spec.sizes) or None)
        name = f"rule.{short_name(overload)}.{len(names)}"
        DEFAULT_REGISTRY.add(dataclasses.replace(spec, name=name, family=FAMILY))
        names.append(name)
    return names
