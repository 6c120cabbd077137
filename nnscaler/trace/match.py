"""Which registered operator a traced call is: rules first, then fixed entries matched by arguments.

A fixed entry matches a call when its annotation binds the call's tensor shapes, each of its ``?``
arguments (resolved with the bound lengths) equals the call's argument at that position, each of its
keyword arguments equals the call's argument of that name, and every other argument of the call is
at its schema default. The first matching entry wins; no match means the op is unknown.
"""
from __future__ import annotations

from typing import Any

from ..dimops.binding import BoundAnno, bind
from ..dimops.grammar import AnnotationError
from ..ops.registry import OpRegistry
from ..ops.rules import OpCall, TensorMeta, aten_overload
from ..ops.spec import OpSpec, resolve
from .calls import flatten_tensor_lists

_ALIASES = {"input": "self", "training": "train"}  # Python keyword -> ATen schema name
_ENUMS = {"reduction": {"none": 0, "mean": 1, "sum": 2}}
_IGNORED = {"cudnn_enable", "cudnn_enabled"}  # backend hints that do not change what the op computes


def _shapes(values) -> list:
    return [tuple(v.shape) if isinstance(v, TensorMeta) else None for v in values]


def _same(a: Any, b: Any, ndim: int | None, name: str) -> bool:
    if name in _ENUMS and isinstance(a, str):
        a = _ENUMS[name].get(a, a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, ndim, name) for x, y in zip(a, b))
    if isinstance(a, (list, tuple)) and len(a) == 1:
        return _same(a[0], b, ndim, name)
    if isinstance(b, (list, tuple)) and len(b) == 1:
        return _same(a, b[0], ndim, name)
    if isinstance(a, (list, tuple)) != isinstance(b, (list, tuple)) and "dim" not in name:
        # conv's padding=1 against the traced [1, 1]: a scalar stands for the same value per dim
        scalar, seq = (b, a) if isinstance(a, (list, tuple)) else (a, b)
        return len(seq) > 0 and all(_same(scalar, x, ndim, name) for x in seq)
    if "dim" in name and ndim and isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool):
        return a % ndim == b % ndim
    if isinstance(a, float) or isinstance(b, float):
        try:
            return float(a) == float(b)
        except (TypeError, ValueError):
            return False
    return a == b


def _schema(call: OpCall):
    try:
        return aten_overload(call.overload)._schema.arguments
    except KeyError:
        return None


def match_fixed(call: OpCall, spec: OpSpec) -> BoundAnno | None:
    """The bound annotation if ``spec`` is this call, else None."""
    schema = _schema(call)
    n = len(spec.anno.inputs)
    if schema is None or len(call.args) > len(schema) or n > len(schema):
        return None
    values = {a.name: call.args[i] if i < len(call.args) else
              call.kwargs.get(a.name, a.default_value if a.has_default_value() else None)
              for i, a in enumerate(schema)}
    ordered = [values[a.name] for a in schema]
    ins = ordered[:n]
    if any(isinstance(v, TensorMeta) != (not t.opaque) for v, t in zip(ins, spec.anno.inputs)):
        return None
    try:
        bound = bind(spec.anno, _shapes(ins), [tuple(o.shape) if o is not None else None for o in call.outputs]
                     if len(call.outputs) == len(spec.anno.outputs) else None)
    except AnnotationError:
        return None
    ndim = next((v.ndim for v in ins if isinstance(v, TensorMeta)), None)
    try:
        for pos, t in enumerate(spec.anno.inputs):
            if t.opaque and not _same(resolve(spec.args[pos], bound.sizes), ins[pos], ndim, schema[pos].name):
                return None
        given = {_ALIASES.get(k, k): resolve(v, bound.sizes) for k, v in spec.kwargs.items()}
    except AnnotationError:
        return None
    for a in schema[n:]:
        if a.name in _IGNORED:
            continue
        if a.name in given:
            want = given.pop(a.name)
        elif a.has_default_value():
            want = a.default_value
        else:
            return None  # a required argument the entry does not fix
        if not _same(want, values[a.name], ndim, a.name):
            return None
    return None if given else bound


def derive(call: OpCall, registry: OpRegistry) -> tuple[OpSpec, BoundAnno] | None:
    """The spec and bound annotation of a call: the first rule that annotates it, else the first
    fixed entry that matches it, else one inferred by probing the call (:func:`.leaves.infer_rule`);
    ``None`` if none of them annotates it."""
    ins = _shapes(flatten_tensor_lists(call.args))
    outs = [tuple(o.shape) if isinstance(o, TensorMeta) else None for o in call.outputs]
    if None in outs:  # an op returning nothing (a metadata assert): outputs bound from the annotation
        outs = None
    for rule in registry.rules(call.overload):
        spec = rule(call)
        if spec is not None:
            try:
                return spec, bind(spec.anno, ins[:len(spec.anno.inputs)], outs, known=dict(spec.sizes) or None)
            except AnnotationError as exc:
                raise AnnotationError(f"rule {getattr(rule, '__name__', rule)} for {call.overload} gave "
                                      f"{spec.annotation!r}, which does not fit the call: {exc}") from None
    for spec in registry.by_aten(call.overload):
        bound = match_fixed(call, spec)
        if bound is not None:
            return spec, bound
    from .leaves import infer_rule  # the last resort: an annotation inferred by probing the call
    spec = None
    if getattr(registry, "infer", False):
        key = repr((call.overload, call.args, sorted(call.kwargs.items())))  # shapes, dtypes and values
        if key not in registry.inferred:
            registry.inferred[key] = infer_rule(call)
        spec = registry.inferred[key]
    if spec is not None:
        try:
            return spec, bind(spec.anno, ins[:len(spec.anno.inputs)], outs, known=dict(spec.sizes) or None)
        except AnnotationError:
            return None
    return None
