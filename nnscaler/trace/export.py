"""``torch.export`` of a user's model, with errors a user can act on."""
from __future__ import annotations

import inspect
import traceback
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch


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


def export_model(model: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None):
    """``torch.export.export(model, args, kwargs, strict=False)``; a failure becomes a
    :class:`TraceError` naming the model, the exception and the user's source line."""
    kwargs = dict(kwargs or {})
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"parallelize needs a torch.nn.Module, got {type(model).__name__}")
    check_arguments(model, args, kwargs)
    try:
        return torch.export.export(model, tuple(args), kwargs, strict=False)
    except Exception as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise TraceError(f"torch.export cannot trace {type(model).__name__}: {type(exc).__name__}: {msg}"
                         f"{_user_frame(exc)}") from exc
