"""Annotations given as functions of the call's inputs (nnScaler's callable annotations).

``register_op(lambda x, dim: ..., examples=[...])`` registers a function whose annotation depends
on the call: the annotation function receives the call's arguments (tensors as
:class:`~nnscaler.ops.rules.TensorMeta`, with ``.shape``, ``.ndim`` and ``.dtype``; everything else
by value, keyword arguments too) and returns the annotation text, non-tensor arguments as ``?``.

* The compiler: a rule on the function's graph node (a ``torch.library.custom_op``'s
  ``ns.name.default``, or the ``aten`` overloads given) derives the annotation of every traced call.
* The harness: each example call (tensors by :class:`TensorMeta` or as real tensors) is registered
  as a fixed entry ``NAME.i`` with its derived annotation and its non-tensor arguments, so
  ``python -m verify op NAME.0`` verifies it like any other operator.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from ..dimops.grammar import AnnotationError
from .rules import OpCall, TensorMeta
from .spec import OpSpec


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorMeta(tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_meta(v) for v in value)
    return value


def annotate_call(name: str, anno_fn: Callable[..., str], args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """The annotation ``anno_fn`` gives one call; an error names the op and the call."""
    try:
        text = anno_fn(*args, **kwargs)
    except Exception as exc:
        raise AnnotationError(f"op {name!r}: its annotation function failed on this call: "
                              f"{type(exc).__name__}: {exc}") from None
    if not isinstance(text, str):
        raise AnnotationError(f"op {name!r}: its annotation function returned {type(text).__name__}, not a string")
    return text


def spec_for_call(name: str, anno_fn: Callable[..., str], fn: Callable, args: Sequence[Any],
                  kwargs: Mapping[str, Any], options: Mapping[str, Any]) -> OpSpec:
    """The fixed spec of one call: its derived annotation, non-tensor arguments as ``?`` values."""
    metas = [_meta(a) for a in args]
    kw = {k: _meta(v) for k, v in kwargs.items()}
    if any(isinstance(v, TensorMeta) for v in kw.values()):
        raise AnnotationError(f"op {name!r}: pass tensors positionally; keyword tensors cannot be annotated")
    text = annotate_call(name, anno_fn, metas, kw)
    values = {i: a for i, a in enumerate(args) if not isinstance(metas[i], TensorMeta)}
    return OpSpec.create(name, text, fn, args=values, kwargs={**dict(options.get("kwargs") or {}), **kwargs},
                         **{k: v for k, v in options.items() if k != "kwargs"})


def register_callable(registry, anno_fn: Callable[..., str], fn: Callable, name: str,
                      examples: Sequence[Any], overloads: Sequence[str], options: Mapping[str, Any]) -> None:
    """Register ``fn`` with a callable annotation: a rule per overload, a fixed entry per example.

    An example is a tuple of positional arguments, or ``(args, kwargs)`` when its last element is a
    dict (``((T(4, 8), 1), {"keepdim": True})``)."""
    if not examples and not overloads:
        raise AnnotationError(f"op {name!r}: a callable annotation needs examples=[...] (for the harness) or a "
                              f"graph node to annotate (a torch.library.custom_op, or aten=...)")
    opts = dict(options)
    opts.setdefault("aten", tuple(overloads))
    for i, example in enumerate(examples):
        if isinstance(example, tuple) and len(example) == 2 and isinstance(example[1], dict) \
                and isinstance(example[0], (tuple, list)):
            ex_args, ex_kwargs = tuple(example[0]), dict(example[1])
        else:
            ex_args, ex_kwargs = (tuple(example) if isinstance(example, (tuple, list)) else (example,)), {}
        registry.add(spec_for_call(f"{name}.{i}", anno_fn, fn, ex_args, ex_kwargs, opts))

    def rule(call: OpCall) -> OpSpec:
        return spec_for_call(name, anno_fn, fn, call.args, dict(call.kwargs), opts)

    rule.__name__ = f"callable_annotation_of_{name}"
    for overload in overloads:
        registry.add_rule(overload, rule)
