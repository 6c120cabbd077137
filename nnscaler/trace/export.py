"""``torch.export`` of a user's model, with errors a user can act on."""
from __future__ import annotations

import inspect
import traceback
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from .functions import refuse_unregistered


class TraceError(ValueError):
    """The model cannot be traced as given (bad sample arguments, or export failed)."""


def _user_frame(exc: BaseException) -> str:
    """``file:line in function`` of the innermost frame outside torch and the standard library."""
    frames = traceback.extract_tb(exc.__traceback__)
    skip = (str(Path(torch.__file__).parent), str(Path(__file__).parents[1]))
    user = [f for f in frames if not f.filename.startswith(skip) and "site-packages" not in f.filename
            and "/lib/python" not in f.filename and not f.filename.startswith("<")]
    if not user:
        return ""
    f = user[-1]
    return f" (at {f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()})"


def check_arguments(model: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Raise :class:`TraceError` unless ``model.forward`` accepts these sample arguments."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise TraceError(f"sample arguments do not match {type(model).__name__}.forward{sig}: {exc}") from None


def _mutates(ep) -> bool:
    """Whether any operator of the exported program writes into a tensor in place."""
    return any(isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
               for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes)


def functional(ep):
    """``ep`` with in-place writes (``t[..., 0] = x``: ``select`` then ``fill_``) replaced by their
    functional forms (``select_scatter``), which a partitioned program can compute shard by shard; a
    write into a view would otherwise be lost once the view is converted to another layout. Programs
    without such writes are returned as they are. ``run_decompositions`` turns ``reshape`` into
    ``view``, valid on the whole tensor but not on every shard a plan makes of it, so views are
    traced back to ``reshape`` (equal wherever ``view`` is valid)."""
    if not _mutates(ep):
        return ep
    with warnings.catch_warnings():  # torch's own pytree deprecation notice, nothing of the user's
        warnings.simplefilter("ignore", FutureWarning)
        ep = ep.run_decompositions({})
    for node in ep.graph.nodes:
        if node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
    ep.graph_module.recompile()
    return ep


def export_model(model: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None):
    """``torch.export.export(model, args, kwargs, strict=False)``; a failure becomes a
    :class:`TraceError` naming the model, the exception and the user's source line."""
    kwargs = dict(kwargs or {})
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"parallelize needs a torch.nn.Module, got {type(model).__name__}")
    check_arguments(model, args, kwargs)
    try:
        ep = torch.export.export(model, tuple(args), kwargs, strict=False)
    except Exception as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise TraceError(f"torch.export cannot trace {type(model).__name__}: {type(exc).__name__}: {msg}"
                         f"{_user_frame(exc)}") from exc
    refused = refuse_unregistered(ep.graph)
    if refused:
        raise TraceError(refused)
    return functional(ep)
