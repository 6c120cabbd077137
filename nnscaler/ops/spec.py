"""What the registry knows about an operator: its annotation, and what the annotation cannot say."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..dimops.grammar import AnnotationError, OpAnno, parse


@dataclass(frozen=True)
class Size:
    """A non-tensor argument that equals identifier lengths, written in annotation syntax:
    ``Size("h")`` is one int, ``Size("a (h d) -1")`` a tuple (write ``(Size("a"),)`` for a 1-tuple). Under a partition it resolves to the
    rank's local lengths, so ``view``/``expand``/``narrow`` arguments follow the split."""

    expr: str

    def names(self) -> set[str]:
        """The identifiers this expression names."""
        return {n for n in re.findall(r"-?[A-Za-z0-9_*]+", self.expr) if not re.fullmatch(r"-?\d+", n)}

    def resolve(self, sizes: Mapping[str, int]) -> int | tuple[int, ...]:
        if not re.fullmatch(r"\s*(?:(?:\([^()]*\)|-?[A-Za-z0-9_*]+)\s*)+", self.expr):
            raise AnnotationError(f"Size({self.expr!r}): expected identifiers, numbers and groups '(h d)'")
        items = re.findall(r"\([^)]*\)|-?[A-Za-z0-9_*]+", self.expr)
        vals = []
        for item in items:
            n = 1
            for name in item.strip("()").split():
                if re.fullmatch(r"-?\d+", name):
                    n *= int(name)
                elif name in sizes:
                    n *= sizes[name]
                else:
                    raise AnnotationError(f"Size({self.expr!r}): unknown identifier {name!r}")
            vals.append(n)
        if not vals:
            raise AnnotationError(f"Size({self.expr!r}) names no identifier")
        return vals[0] if len(vals) == 1 else tuple(vals)


def resolve(value: Any, sizes: Mapping[str, int]) -> Any:
    """Replace every :class:`Size` inside ``value`` (lists, tuples, dicts too) by its lengths."""
    if isinstance(value, Size):
        return value.resolve(sizes)
    if isinstance(value, (list, tuple)):
        return type(value)(resolve(v, sizes) for v in value)
    if isinstance(value, dict):
        return {k: resolve(v, sizes) for k, v in value.items()}
    return value


def size_names(value: Any) -> set[str]:
    """Identifiers named by every :class:`Size` inside ``value`` (lists, tuples, dicts too)."""
    if isinstance(value, Size):
        return value.names()
    if isinstance(value, (list, tuple)):
        return set().union(*(size_names(v) for v in value))
    if isinstance(value, dict):
        return set().union(*(size_names(v) for v in value.values()))
    return set()


def outputs_of(anno: OpAnno, result: Any) -> tuple:
    """An operator's result as one value per annotated output: a function whose annotation names a
    single ``?`` output returns it whole (a list or tuple stays one opaque output); otherwise a
    tuple or list is one output per element."""
    if len(anno.outputs) == 1 and anno.outputs[0].opaque:
        return (result,)
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


# --- value constraints for sample inputs ----------------------------------------------------------

@dataclass(frozen=True)
class Positive:
    """Strictly positive floats (for log, sqrt, rsqrt, ...)."""

    low: float = 0.25
    high: float = 2.0


@dataclass(frozen=True)
class Uniform:
    """Floats drawn uniformly from ``[low, high)`` (for asin, atanh, ...)."""

    low: float
    high: float


@dataclass(frozen=True)
class Index:
    """Integer indices in ``[0, high)``; ``high`` is an int or an identifier whose length it is."""

    high: int | str
    dtype: str = "int64"


@dataclass(frozen=True)
class Mask:
    """A boolean mask, true with probability ``p``."""

    p: float = 0.5


@dataclass(frozen=True)
class Complex:
    """Complex numbers of the case's precision (complex64 for float32 and bfloat16, which has no
    complex type; complex128 for float64), real and imaginary parts standard normal."""


Constraint = Positive | Uniform | Index | Mask | Complex


@dataclass(frozen=True)
class Tolerance:
    """Overrides the tolerance policy of ``verify.compare`` for one operator."""

    factor: float | None = None  # times the single-device error against float64
    floor_eps: float | None = None  # times the dtype's epsilon times the reference's magnitude


@dataclass(frozen=True)
class OpSpec:
    """One registered operator.

    ``fn`` is called as ``fn(*inputs, **kwargs)`` with one positional argument per annotated input
    (``?`` positions take their value from ``args``). ``local``, when given, is the partition-aware
    kernel a rank runs instead: ``local(shard, *inputs, **kwargs)`` with a
    :class:`nnscaler.runtime.partitioned.ShardContext`.
    """

    name: str
    annotation: str
    fn: Callable
    anno: OpAnno
    family: str = "custom"
    aten: tuple[str, ...] = ()
    args: Mapping[int, Any] = field(default_factory=dict)
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    inputs: Mapping[int, Constraint] = field(default_factory=dict)
    sizes: Mapping[str, int] = field(default_factory=dict)
    star: int = 2
    tolerance: Tolerance | None = None
    local: Callable | None = None
    differentiable: bool = True
    # identifiers whose split makes ``local`` issue one collective of its own per call (forward, and
    # one in the backward): statistics over a split batch (batch norm); counted apart in plan reports
    coupled: tuple[str, ...] = ()
    # ``(identifier, input positions)``: a split of the identifier makes ``local`` pass those inputs rank to rank
    # around the ring of its mesh axis, one send per step (ring attention's keys and values, their gradients back
    # in the backward); counted in plan reports as ``send_recv`` (:func:`nnscaler.cost.steps.exchange_collectives`)
    exchange: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # identifiers ``local`` reads in any order (the rows of a reduced loss: a sum and a count): a
    # split of one may follow blocks its input holds (:func:`nnscaler.policies.greedy.held_blocks`);
    # ``local`` indexes contiguous chunks of every other split identifier
    unordered: tuple[str, ...] = ()
    doc: str = ""

    @classmethod
    def create(cls, name: str, annotation: str, fn: Callable, **options) -> "OpSpec":
        """Validate and build a spec; a malformed annotation raises ``AnnotationError``."""
        anno = parse(annotation)
        args = dict(options.pop("args", None) or {})
        for pos in args:
            if not (0 <= pos < len(anno.inputs)) or not anno.inputs[pos].opaque:
                raise AnnotationError(f"op {name!r}: args[{pos}] given, but input {pos} of {annotation!r} is not '?'")
        for pos, t in enumerate(anno.inputs):
            if t.opaque and pos not in args:
                raise AnnotationError(f"op {name!r}: input {pos} of {annotation!r} is '?'; give its value with args={{{pos}: ...}}")
        inputs = dict(options.pop("inputs", None) or {})
        for pos in inputs:
            if not (0 <= pos < len(anno.inputs)) or anno.inputs[pos].opaque:
                raise AnnotationError(f"op {name!r}: constraint for input {pos}, which is not a tensor of {annotation!r}")
        aten = options.pop("aten", ())
        aten = (aten,) if isinstance(aten, str) else tuple(aten)
        return cls(name=name, annotation=annotation, fn=fn, anno=anno, args=args, inputs=inputs, aten=aten,
                   **options)
