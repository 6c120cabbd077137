"""State a model's forward writes: the buffers it updates in place (carried out by the generated
program, :class:`~nnscaler.ir.graph.BufferWrite`, from ``torch.export``'s ``BUFFER_MUTATION``
outputs), the parameters it writes (refused by name) and the Python attributes it sets on ``self``
(counters, flags, caches: a compiled program runs no Python, so they are named in a
:class:`FrozenAttributeWarning`)."""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, Sequence

import torch
from torch.export.graph_signature import OutputKind

from ..ir.graph import BufferWrite, IRTensor
from .export import TraceError

_STANDARD = frozenset(vars(torch.nn.Module()))  # what every module holds (_parameters, hooks, training, ...)


class FrozenAttributeWarning(UserWarning):
    """A Python attribute the model's forward writes: the compiled program keeps the value it had
    when traced."""


class StateWriteError(TraceError):
    """A write of forward the compiled program cannot carry out (a parameter written in place)."""


def _line(value: Any) -> str:
    """The model's line that computed ``value`` (through the ``detach`` ending a no_grad region)."""
    op = getattr(value, "producer", None)
    source = getattr(op, "source", "") or ""
    if source.startswith("the end of") and op.inputs:
        return _line(op.inputs[0])
    return source


def buffer_writes(model: torch.nn.Module, specs: Sequence, outputs: Sequence, buffers: Sequence[IRTensor]
                  ) -> list[BufferWrite]:
    """The buffer each ``BUFFER_MUTATION`` output of the exported program (``specs``, its
    ``output_specs``; ``outputs``: their traced values) writes, in order. A parameter written in place
    is a :class:`StateWriteError` naming it and the model's line."""
    by_target = {t.target: t for t in buffers}
    out = []
    for spec, value in zip(specs, outputs):
        where = _line(value)
        at = f" (at {where})" if where else ""
        if spec.kind == OutputKind.PARAMETER_MUTATION:
            raise StateWriteError(f"{type(model).__name__}.forward writes parameter {spec.target} in place{at}: "
                                  f"the compiled program cannot carry that out (its optimizer owns parameters); "
                                  f"keep the state in a buffer (register_buffer) or write it outside forward")
        if spec.kind != OutputKind.BUFFER_MUTATION:
            continue
        buffer = by_target.get(spec.target)
        if buffer is None or not isinstance(value, IRTensor):
            raise StateWriteError(f"{type(model).__name__}.forward writes buffer {spec.target} in place{at}, "
                                  f"which the trace cannot follow; write it outside forward")
        out.append(BufferWrite(buffer, value, where))
    return out


def _marker(value: Any) -> Any:
    """What is compared to tell a written attribute: the value itself for plain values, the items'
    identities for a list, tuple, dict or set (an appended cache entry), else the object's identity."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return ("value", type(value), value)
    if isinstance(value, (list, tuple)):
        return ("items", type(value), tuple(map(id, value)))
    if isinstance(value, dict):
        return ("items", dict, tuple((k, id(v)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return ("items", type(value), len(value))
    return ("object", id(value))


def _attributes(model: torch.nn.Module) -> dict[str, tuple[Any, Any]]:
    """``path -> (value, marker)`` of every Python attribute of every module (``calls`` of the model,
    ``layers.0.flag``): neither tensors nor modules nor what every module holds."""
    out = {}
    for prefix, module in model.named_modules():
        for k, v in vars(module).items():
            if k in _STANDARD or isinstance(v, (torch.Tensor, torch.nn.Module)):
                continue
            out[f"{prefix}.{k}" if prefix else k] = (v, _marker(v))
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@contextlib.contextmanager
def watch_attributes(model: torch.nn.Module) -> Iterator[list[str]]:
    """Within: every forward of ``model`` compares its modules' Python attributes before and after;
    on exit the ones written are named, once each, in a :class:`FrozenAttributeWarning`
    (``torch.export`` restores them after tracing, so the program keeps the traced value)."""
    written: dict[str, tuple[Any, Any]] = {}
    before: list[dict] = []

    def pre(module, args):
        before.append(_attributes(model))

    def post(module, args, output):
        old = before.pop() if before else {}
        now = _attributes(model)
        for path in sorted(set(old) | set(now)):
            if path in written:
                continue
            a, b = old.get(path), now.get(path)
            if a is None or b is None or a[1] != b[1]:
                written[path] = (a[0] if a else "unset", b[0] if b else "deleted")

    handles = [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]
    names: list[str] = []
    try:
        yield names
    finally:
        for h in handles:
            h.remove()
    for path, (old, new) in written.items():
        names.append(path)
        warnings.warn(f"{type(model).__name__}.forward writes the Python attribute {path} "
                      f"({_short(old)} -> {_short(new)} in the traced call): the compiled program runs no "
                      f"Python, so {path} is frozen at its value when traced and forward reads it as that "
                      f"constant; keep such state in a buffer (register_buffer) or update it outside forward",
                      FrozenAttributeWarning, stacklevel=3)
