"""Graph nodes as :class:`~nnscaler.ops.rules.OpCall` values: what the annotation rules see."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx

from ..ops.rules import OpCall, TensorMeta


def meta_of(value: Any) -> Any:
    """A node argument's value: tensors (fake or real) as TensorMeta, containers element-wise."""
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
    if isinstance(value, torch.Tensor):
        return TensorMeta(tuple(int(s) for s in value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(meta_of(v) for v in value)
    if isinstance(value, torch.SymInt):
        return int(value)
    return value


def overload_name(target: Any) -> str:
    """``torch.ops.aten.view.default`` -> ``"aten.view.default"``; other callables by qualified name."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}".lstrip(".")


def call_of(node: torch.fx.Node) -> OpCall:
    """The call a ``call_function`` node makes, with its output metas."""
    out = node.meta.get("val")
    outs = tuple(meta_of(o) for o in out) if isinstance(out, (list, tuple)) else (meta_of(out),)
    return OpCall(overload_name(node.target), tuple(meta_of(a) for a in node.args),
                  {k: meta_of(v) for k, v in node.kwargs.items()}, outs)


def flatten_tensor_lists(args) -> list:
    """Positional arguments with every list of tensors spread into its elements: the convention by
    which an annotation names each tensor of ``cat([x, y], dim)`` as its own input (``x, y, ?``).
    Leading ``None`` entries of such a list (``x[:, :, i]``'s index list) are dropped: the rule's
    function puts them back."""
    out = []
    for a in args:
        tensors = _after_nones(a)
        if tensors:
            out.extend(tensors)
        else:
            out.append(a)
    return out


def _after_nones(a) -> list:
    """The elements of a list or tuple of tensors after its leading ``None`` entries (``[]`` for
    anything else)."""
    if not isinstance(a, (list, tuple)):
        return []
    rest = list(a)
    while rest and rest[0] is None:
        rest.pop(0)
    ok = rest and all(isinstance(v, (TensorMeta, torch.Tensor)) or type(v).__name__ == "IRTensor" for v in rest)
    return rest if ok else []
