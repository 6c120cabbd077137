"""Python source for the values and callables a generated program uses."""
from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from typing import Any, Callable

import torch


class CodegenError(RuntimeError):
    """Something the generated program cannot name or write down."""


class Raw(str):
    """Source text to write as it is (an expression naming a callable, say)."""


def comment(text: str) -> str:
    """``text`` made safe for the rest of one ``#`` comment line (no line breaks, no control characters)."""
    text = str(text)
    return text if text.isprintable() else "".join(ch if ch.isprintable() else " " for ch in text)


def literal(value: Any) -> str:
    """Source text that evaluates to ``value`` (numbers, strings, containers, dtypes, devices)."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return repr(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "float('nan')"
        if math.isinf(value):
            return "float('inf')" if value > 0 else "float('-inf')"
        return repr(value)
    if isinstance(value, torch.dtype) or isinstance(value, (torch.layout, torch.memory_format)):
        return repr(value) if repr(value).startswith("torch.") else f"torch.{str(value).split('.')[-1]}"
    if isinstance(value, torch.device):  # accelerators: this rank's own device, whatever traced it
        return "torch.device('cpu')" if value.type == "cpu" else "DEVICE"
    if isinstance(value, list):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    if isinstance(value, tuple):
        return "(" + ", ".join(literal(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{literal(k)}: {literal(v)}" for k, v in value.items()) + "}"
    raise CodegenError(f"cannot write {type(value).__name__} value {value!r} into generated code")


def _resolves(path: str, obj: Any) -> bool:
    module, _, attr = path.partition(":")
    try:
        target = importlib.import_module(module)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError):
        return False
    return target is obj


def callable_source(fn: Callable) -> tuple[str, dict[str, Any], str | None]:
    """(expression naming ``fn``, keyword arguments bound by a ``functools.partial``, module to
    import); raises :class:`CodegenError` for a callable with no importable name (a lambda)."""
    kwargs: dict[str, Any] = {}
    if isinstance(fn, functools.partial):
        if fn.args:
            raise CodegenError(f"cannot name a partial with positional arguments: {fn!r}")
        kwargs = dict(fn.keywords)
        fn = fn.func
    if dataclasses.is_dataclass(fn) and not isinstance(fn, type):  # a callable object made of plain data
        cls = type(fn)
        if _resolves(f"{cls.__module__}:{cls.__qualname__}", cls):
            fields = ", ".join(f"{f.name}={literal(getattr(fn, f.name))}" for f in dataclasses.fields(fn))
            return f"{cls.__module__}.{cls.__qualname__}({fields})", kwargs, cls.__module__
    if isinstance(fn, torch._ops.OpOverload):
        return f"torch.ops.{fn.namespace}.{fn._schema.name.split('::')[-1]}.{fn._overloadname}", kwargs, None
    for name in ("view", "expand", "contiguous", "reshape", "permute"):
        if fn is getattr(torch.Tensor, name, None):
            return f"torch.Tensor.{name}", kwargs, None
    short = getattr(fn, "__name__", "")
    for public in ("torch.nn.functional", "torch"):  # the public name of a torch function
        if getattr(fn, "__module__", "") and str(fn.__module__).startswith("torch") and _resolves(f"{public}:{short}", fn):
            return f"{public}.{short}", kwargs, (public if public != "torch" else None)
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module and qualname and "<" not in qualname and _resolves(f"{module}:{qualname}", fn):
        return f"{module}.{qualname}", kwargs, module
    for public in ("torch.nn.functional", "torch"):
        if _resolves(f"{public}:{short}", fn):
            return f"{public}.{short}", kwargs, (public if public != "torch" else None)
    raise CodegenError(f"cannot name {fn!r} in generated code: register the operator with a module-level function")
