"""What the tracer's graph rewrites (``rows.py``, ``heads.py``) share: reading a node's traced shape,
and giving a new node the value and source a rewritten one had."""
from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten
RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def shape_of(node) -> tuple[int, ...] | None:
    """The traced shape of ``node``'s tensor value (None for a non-tensor or a constant)."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


def set_meta(node: torch.fx.Node, like: torch.fx.Node, val) -> None:
    """Give a new ``node`` its traced value ``val`` and the source (stack trace, module) of ``like``,
    the node it stands in for, so operators keep the model's source line."""
    node.meta["val"] = val
    for key in ("stack_trace", "nn_module_stack"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
