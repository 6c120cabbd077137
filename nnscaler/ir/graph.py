"""The compiler's IR: whole tensors, and operators that carry their registry spec and bound annotation.

A tensor is a value in the traced program (a parameter, buffer, user input, activation or the loss)
with its full shape. An operator reads tensors and constants and writes tensors; ``spec`` and
``bound`` come from the one registry (``None`` for an operator the registry does not know, which is
replicated). Several operators may read one tensor; each is free to want its own layout of it.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..dimops.binding import BoundAnno
from ..dimops.partition import OpLayout, Partition, op_layout
from ..ops.rules import aten_overload
from ..ops.spec import OpSpec

PARAM, BUFFER, INPUT, ACTIVATION, CONSTANT = "param", "buffer", "input", "activation", "constant"


@dataclass(eq=False)
class IRTensor:
    """One whole tensor of the traced program."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str = ACTIVATION
    target: str = ""  # a parameter's or buffer's name in the model (``layers.0.linear.weight``)
    producer: "IROp | None" = None
    consumers: list["IROp"] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"{self.name}{list(self.shape)}"


@dataclass(eq=False)
class IROp:
    """One operator call; ``inputs`` hold IRTensors or constant values, ``outputs`` IRTensors (None
    for a non-tensor result)."""

    name: str
    overload: str
    inputs: list[Any]
    outputs: list[IRTensor | None]
    kwargs: dict[str, Any] = field(default_factory=dict)
    spec: OpSpec | None = None
    bound: BoundAnno | None = None
    source: str = ""  # "file:line: code" of the model line that made it
    scope: tuple[str, ...] = ()  # the model's modules it ran in, outermost first (``h.0``, ``h.0.attn``)
    scope_types: tuple[str, ...] = ()  # those modules' class names (``Block``, ``CausalSelfAttention``)
    cast: Any = None  # bf16-mixed: the dtype its floating inputs are cast to, "drop" for a dtype assert (runtime/precision.py)
    checkpoint: int | None = None  # the model's torch.utils.checkpoint call it ran in (trace/checkpoints.py)
    literals: dict | None = None  # bf16-mixed: {traced constant: the one it computes with} (trace/amp.py)
    sequence: bool = False  # the call returns a list or tuple (``unbind`` of a length-1 dim: a list of one)
    _layouts: dict = field(default_factory=dict, repr=False, compare=False)  # layout()'s answers, see there

    @property
    def known(self) -> bool:
        return self.spec is not None

    def layout(self, partition: Partition) -> OpLayout:
        """The layouts of this (known) op's inputs and outputs under ``partition``; floating inputs
        may be partial values, others are replicated instead."""
        floating = tuple(isinstance(x, IRTensor) and x.dtype.is_floating_point for x in self.inputs[:len(self.bound.inputs)])
        # planning and code generation ask for the same layouts many times: a pure function of the
        # bound annotation (kept to check it is still this op's), the partition and the inputs' kinds
        known = self._layouts.get((partition, floating))
        if known is not None and known[0] is self.bound:
            return known[1]
        out = op_layout(self.bound, partition, floating)
        self._layouts[(partition, floating)] = (self.bound, out)
        return out

    def tensor_inputs(self) -> list[IRTensor]:
        """Every tensor this op reads, in order: positional, nested in lists, tuples and dicts, and
        keyword arguments. An annotated op has its tensor lists spread into ``inputs`` already, but an
        operator without annotation keeps its arguments as traced (``aten.concatenate([h0, h1], 2)``,
        ``torch.stack`` of a recurrence's steps), and a tensor read only from such a list is still
        read: missing it dropped its consumer and, in :meth:`IRGraph.carries_grad`, the gradient of
        everything computed from the list, so conversions downstream skipped the backward collectives
        that sum partial gradients."""
        return tensors_in(self.inputs) + tensors_in(self.kwargs)

    @property
    def draws_random(self) -> bool:
        """Whether the call draws random numbers: an ATen op tagged ``nondeterministic_seeded``, unless
        its schema has a dropout probability (``p``, ``dropout_p``, a recurrent layer's ``dropout``) that is 0 here or a ``train`` flag
        that is false (a dropout in eval mode, attention without dropout)."""
        try:
            overload = aten_overload(self.overload)
        except (KeyError, ValueError):  # a registered Python function, not an ATen overload
            return False
        if torch.Tag.nondeterministic_seeded not in overload.tags:
            return False
        given = {}
        schema = overload._schema.arguments  # (torch.FunctionSchema has no public accessor)
        # an annotated op has its tensor lists spread into ``inputs`` (gru's weights): arguments after
        # the last list sit that much further on
        lists = [i for i, a in enumerate(schema) if str(a.type) in ("List[Tensor]", "Tensor[]")]
        spread = max(0, len(self.inputs) - len([a for a in schema if not a.kwarg_only])) if self.known else 0
        for i, arg in enumerate(schema):
            at = i + spread if lists and i > lists[-1] else i
            if arg.name in self.kwargs:
                given[arg.name] = self.kwargs[arg.name]
            elif at < len(self.inputs) and not arg.kwarg_only:
                given[arg.name] = self.inputs[at]
            elif arg.has_default_value():
                given[arg.name] = arg.default_value
        p = given.get("p", given.get("dropout_p", given.get("dropout", 1.0)))  # dropout: rnn/gru/lstm
        return bool(p) and bool(given.get("train", True))

    def __repr__(self) -> str:
        anno = self.spec.annotation if self.spec else "unknown"
        return f"{self.name} = {self.overload}({', '.join(map(repr, self.inputs))})  # {anno}"


GUARD = "nnscaler.guard"
"""``IROp.overload`` of a guard the program checks at run time (``nnscaler/trace/branches.py``): it reads
its inputs whole, computes nothing, and raises where a data-dependent value differs from the traced
one; ``kwargs``: ``cond`` (Python source, ``{i}`` standing for input i) and ``message``."""


@dataclass(eq=False)
class BufferWrite:
    """A buffer the model's forward writes in place (``self.ema.mul_(0.5).add_(...)``, ``copy_``,
    ``index_put_``, through views): once forward has run, ``buffer`` holds ``value``, the functional
    form ``torch.export`` recorded (``OutputKind.BUFFER_MUTATION``). ``source``: the model's line."""

    buffer: IRTensor
    value: IRTensor
    source: str = ""


def tensors_in(value: Any) -> list[IRTensor]:
    """The :class:`IRTensor` s in ``value`` (an argument: a tensor, or lists, tuples and dicts of
    them and of constants), in order."""
    if isinstance(value, IRTensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def remap(value: Any, tensor: Callable[[IRTensor], IRTensor]) -> Any:
    """``value`` (an operator's argument: a tensor, or lists, tuples and dicts of them and of
    constants) with every :class:`IRTensor` replaced by ``tensor(it)``."""
    if isinstance(value, IRTensor):
        return tensor(value)
    if isinstance(value, (list, tuple)):
        return type(value)(remap(x, tensor) for x in value)
    if isinstance(value, dict):
        return {k: remap(x, tensor) for k, x in value.items()}
    return value


@dataclass
class IRGraph:
    """Operators in program order, with the program's inputs, parameters, buffers and outputs."""

    ops: list[IROp]
    inputs: list[IRTensor]
    params: list[IRTensor]
    buffers: list[IRTensor]
    outputs: list[Any]
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # lifted tensor constants by name
    exported: Any = field(default=None, repr=False, compare=False)  # the torch.export program it came from (precision.py reads it)
    writes: list[BufferWrite] = field(default_factory=list)  # buffers forward writes in place, in program order

    def copy(self) -> "IRGraph":
        """A copy to compile on (``parallelize`` renames tied parameters and keeps the graph): new
        tensors and operators, linked alike; the registry's specs and bound annotations, constant
        values and lifted constants are shared (never written). Iterative: ``copy.deepcopy`` recurses
        along producer/consumer links and overflows the stack on a deep model."""
        pairs: dict[int, tuple[IRTensor, IRTensor]] = {}  # id(old) -> (old, new)

        def tensor(t: IRTensor) -> IRTensor:
            if id(t) not in pairs:
                pairs[id(t)] = (t, dataclasses.replace(t, producer=None, consumers=[]))
            return pairs[id(t)][1]

        def value(v: Any) -> Any:
            return remap(v, tensor)

        ops = {id(op): dataclasses.replace(op, inputs=value(op.inputs), kwargs=value(op.kwargs),
                                           outputs=[None if t is None else tensor(t) for t in op.outputs])
               for op in self.ops}
        graph = dataclasses.replace(self, ops=[ops[id(op)] for op in self.ops], inputs=value(self.inputs),
                                    params=value(self.params), buffers=value(self.buffers),
                                    outputs=value(self.outputs), constants=dict(self.constants),
                                    writes=[BufferWrite(tensor(w.buffer), tensor(w.value), w.source) for w in self.writes])
        for old, new in pairs.values():
            new.producer = None if old.producer is None else ops.get(id(old.producer))
            new.consumers = [ops[id(c)] for c in old.consumers if id(c) in ops]
        return graph

    def carries_grad(self) -> set[IRTensor]:
        """Tensors a gradient can flow to: floating parameters and user inputs, and the floating
        outputs of differentiable operators reading one (a mask or rotary table made from buffers
        and positions carries none, so no collective is spent on its gradient)."""
        out = {t for t in self.params + self.inputs if t.dtype.is_floating_point or t.dtype.is_complex}
        for op in self.ops:
            if (op.spec is None or op.spec.differentiable) and any(x in out for x in op.tensor_inputs()):
                out.update(t for t in op.outputs if t is not None and (t.dtype.is_floating_point or t.dtype.is_complex))
        return out

    def reach_outputs(self) -> set[IRTensor]:
        """Tensors an output is computed from through operators that may be differentiated, by way of
        floating results (an index or a mask carries no gradient): the only ones backward from the
        outputs can give a gradient. A parameter read only by work the
        outputs drop (a compressor a short sequence skips) gets none, on one device as on ranks."""
        out: set[IRTensor] = set()
        todo = list(self.outputs)
        while todo:  # outputs may be lists or tuples of tensors
            x = todo.pop()
            if isinstance(x, IRTensor):
                out.add(x)
            elif isinstance(x, (list, tuple)):
                todo += list(x)
        for op in reversed(self.ops):
            if (op.spec is None or op.spec.differentiable) and any(
                    t in out and (t.dtype.is_floating_point or t.dtype.is_complex) for t in op.outputs if t is not None):
                # every tensor nested anywhere in its arguments (not only the annotated ones): one
                # missed here would lose its gradient outright, so this errs on the side of keeping it
                out.update(tensors_in(op.inputs) + tensors_in(op.kwargs))
        return out

    def unknown(self) -> list[IROp]:
        """Operators with no annotation (a guard on a data-dependent value, :data:`GUARD`, reads its
        tensors whole by design: it is none of them)."""
        return [op for op in self.ops if not op.known and op.overload != GUARD]

    def unknown_summary(self) -> str:
        """Each unknown overload once, with its count and first source line."""
        counts = Counter(op.overload for op in self.unknown())
        first = {}
        for op in self.unknown():
            first.setdefault(op.overload, op.source)
        return "; ".join(f"{o} x{n}" + (f" (first at {first[o]})" if first[o] else "") for o, n in counts.items())

    def __str__(self) -> str:
        return "\n".join(map(repr, self.ops))
