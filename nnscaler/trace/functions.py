"""Custom ``torch.autograd.Function``s in a traced model.

``torch.export`` traces a ``Function`` into the ATen operators of its ``forward`` and drops its
``backward`` without a word (a straight-through estimator loses its gradient). Export leaves no mark
of the ``Function`` in the graph, so the compiler finds its operators by their source lines: a node
whose stack trace passes through the ``forward`` of a ``Function`` subclass came from one. A
``Function`` registered with :func:`nnscaler.register_op` is one operator, a custom op, with its own
backward; an unregistered one is made so with an inferred annotation (:mod:`.leaves`), and a model
still holding one after that is refused, naming the ``Function``, the model's line and the fix."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import torch
import torch.fx

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in \S+')


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_subclasses(sub))
    return out


def user_functions() -> dict[str, list[tuple[int, int, type]]]:
    """File -> ``(first, last line, class)`` of the ``forward`` of every ``Function`` subclass defined
    outside torch (torch's own are dispatcher-level and export handles them)."""
    torch_dir = str(Path(torch.__file__).parent)
    out: dict[str, list[tuple[int, int, type]]] = {}
    for cls in _subclasses(torch.autograd.Function):
        forward = cls.__dict__.get("forward")
        if forward is None or getattr(cls, "_nnscaler_custom_op", None) is not None:
            continue
        fn = forward.__func__ if isinstance(forward, (staticmethod, classmethod)) else forward
        try:
            path = inspect.getsourcefile(fn)
            if not path or path.startswith(torch_dir):
                continue
            lines, first = inspect.getsourcelines(fn)
        except (TypeError, OSError):
            continue
        out.setdefault(path, []).append((first, first + len(lines) - 1, cls))
    return out


def applied_function(node: torch.fx.Node, functions: dict) -> tuple[type, str] | None:
    """The ``Function`` whose ``forward`` made ``node``, and the ``file:line`` that applied it."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    for i, (path, line) in enumerate(frames):
        for first, last, cls in functions.get(path, ()):
            if first <= int(line) <= last:
                caller = next((f"{p}:{n}" for p, n in reversed(frames[:i])
                               if "/torch/" not in p), f"{path}:{line}")
                return cls, caller
    return None


def refusal(cls: type, where: str) -> str:
    """The error for a model still holding unregistered ``Function`` ``cls`` (applied at ``where``)."""
    return (f"{cls.__module__}.{cls.__qualname__} is a torch.autograd.Function (applied at {where}): "
            f"torch.export would inline its forward and silently drop its backward. Register it with "
            f"@nnscaler.register_op(\"<annotation>\") on the class (it then stays one operator with its "
            f"own backward), or write it as a torch.library.custom_op with register_autograd")
