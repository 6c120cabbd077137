"""Models that branch on their data (``if x.sum() > 0:``, ``if idx.size(0) > 0:`` after a
boolean index, ``.item()``, ``.tolist()`` sizes): traced on the branch the sample input takes, each
such choice kept as a guard that the generated program checks at run time.

``torch.export`` stops at a guard on a data-dependent value. Under torch's real-tensor propagation
(what ``torch.export.draft_export`` runs), it evaluates such a guard on the sample's real values
and records it as a runtime assertion instead: an ``aten._assert_scalar`` node whose condition is
computed from the tensors by ``item``/``sym_size`` nodes. :func:`specialise` turns those into
guards the program evaluates on the whole tensors, and fixes every data-dependent size and scalar
argument to its sample value (the plan has static shapes), guarding that equality too: a later
input that takes the other branch, or gives another size, raises one line naming the model's line.
"""
from __future__ import annotations

import contextlib
import logging
import math
import operator
import re
import traceback
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Iterator
from unittest import mock

import torch
import torch.fx

SYM = (torch.SymInt, torch.SymBool, torch.SymFloat)
_DROPPED = {torch.ops.aten.sym_constrain_range_for_size.default, torch.ops.aten.sym_constrain_range.default}
ASSERT = torch.ops.aten._assert_scalar.default
_SAID = re.compile(r"failed for expression (.+) on node")  # torch's message of a runtime assertion

_INFIX = {operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/", operator.floordiv: "//",
          operator.mod: "%", operator.pow: "**", operator.eq: "==", operator.ne: "!=", operator.lt: "<",
          operator.le: "<=", operator.gt: ">", operator.ge: ">=", operator.and_: "and", operator.or_: "or"}
_CALLS = {torch.sym_max: "max", torch.sym_min: "min", torch.sym_float: "float", torch.sym_int: "int",
          math.floor: "math.floor", math.ceil: "math.ceil", operator.neg: "-", operator.abs: "abs"}


class BranchError(ValueError):
    """A data-dependent value the generated program cannot recompute (an operation on it that
    :func:`render` does not know): refused by name, never specialised silently."""


def data_dependent(exc: BaseException) -> bool:
    """Whether ``torch.export`` stopped at a guard on a data-dependent value."""
    text = f"{type(exc).__name__}: {exc}"
    return "GuardOnDataDependentSymNode" in text or "data-dependent expression" in text


DECIDED = "nnscaler_decided"  # ep.graph_module.meta key: the guards decided on the sample (export.py)


class _Decisions(logging.Handler):
    """Collects torch's ``propagate_real_tensors`` log records: each guard decided on the sample,
    as ``(expression, value, the model's line deciding it)`` (torch records no stack for them
    unless debugging, so the line is read here, from the stack of the call that logs)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.decided: list[tuple[Any, Any, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("propagate_real_tensors") and len(record.args or ()) == 2:
            own = (str(Path(torch.__file__).parent), str(Path(__file__).parents[1]), str(Path(logging.__file__).parent))
            frames = [f for f in traceback.extract_stack() if not f.filename.startswith(own)]
            where = f"{frames[-1].filename}:{frames[-1].lineno}: {(frames[-1].line or '').strip()}" if frames else ""
            self.decided.append((*record.args, where))


@contextlib.contextmanager
def specialising() -> Iterator[list]:
    """Within: ``torch.export`` runs every operator on the real sample values too and decides each
    data-dependent guard on them, leaving a runtime assertion in the graph (torch's real-tensor
    propagation, ``torch._functorch.config.fake_tensor_propagate_real_tensors``, as
    ``torch.export.draft_export`` runs it).

    torch 2.13 copies the real values only of tensors whose type is exactly ``torch.Tensor``
    (``torch._subclasses.meta_utils._safe_copy``/``_safe_clone``, which must not copy a FakeTensor):
    a ``nn.Parameter``'s real copy is left uninitialised and a branch on a parameter's result is
    decided on garbage (measured: a linear layer's ``h.sum() > 0`` took either branch at random).
    Its ``.data`` (a plain tensor of the same storage) is what gets copied here.

    ``t.data`` of an activation (I-BERT's ``x_act.data.min()``) is read as ``t.detach()`` here (the
    same values, no gradient): under real-tensor propagation torch records ``.data`` as a constant
    holding a fake tensor, and refuses the program (or stops lifting it with a ``StopIteration``).

    Yields the list of the guards decided, ``(expression, value)``, filled as the trace runs (see
    :func:`unchecked`)."""
    import torch._functorch.config as functorch_config
    import torch._subclasses.meta_utils as meta_utils
    copy, clone = meta_utils._safe_copy, meta_utils._safe_clone
    data = torch.Tensor.data

    def plain(src: Any) -> Any:
        return src.data if type(src) is torch.nn.Parameter else src

    shapes = logging.getLogger("torch.fx.experimental.symbolic_shapes")  # a warning per decided guard:
    level = shapes.level  # the guards are named once, by the trace (SpecialisedBranchWarning)
    shapes.setLevel(logging.WARNING)
    propagate, shapes.propagate = shapes.propagate, False
    decisions = _Decisions()
    handlers, shapes.handlers = shapes.handlers, [decisions]  # (torch's own print each decision)
    try:
        with functorch_config.patch(fake_tensor_propagate_real_tensors=True), \
                mock.patch.object(meta_utils, "_safe_copy", lambda dst, src: copy(dst, plain(src))), \
                mock.patch.object(meta_utils, "_safe_clone", lambda src: clone(plain(src))), \
                mock.patch.object(torch.Tensor, "data", property(torch.Tensor.detach, data.__set__)):
            yield decisions.decided
    finally:
        shapes.handlers = handlers
        shapes.setLevel(level)
        shapes.propagate = propagate


def _user_frame(stack) -> str:
    """``file:line: code`` of the innermost frame of ``stack`` (a ``CapturedTraceback``) outside torch."""
    torch_dir = str(Path(torch.__file__).parent)
    frames = [f for f in stack.summary() if not f.filename.startswith(torch_dir)]
    return f"{frames[-1].filename}:{frames[-1].lineno}: {(frames[-1].line or '').strip()}" if frames else ""


def unchecked(ep, decided: list) -> str:
    """A guard torch decided on the sample (:func:`specialising`) whose data-dependent values the
    program no longer computes, so that no runtime assertion can check it (a size made from
    ``int(x.sum().item() ** 0.5)``: torch keeps the size, drops the ``item`` and its assertion), named
    with the model's line; ``""`` if every decided guard is over values the program computes."""
    checked: set = set()  # symbols a runtime assertion reads, or a tensor's size (specialise guards it)
    env = None
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        if node.target is ASSERT:
            checked |= set(_SYMBOL.findall(str(node.args[1]) if len(node.args) > 1 else ""))
        elif isinstance(val, torch.Tensor):
            checked |= {str(s) for d in _vals(val) for s in d.node.expr.free_symbols}
        env = env or getattr(getattr(val, "fake_mode", None), "shape_env", None)
    for expr, value, where in decided:
        missing = [s for s in getattr(expr, "free_symbols", ()) if str(s) not in checked]
        if missing:
            stack = getattr(env, "var_to_stack", {}).get(missing[0])
            where = where or (_user_frame(stack) if stack is not None else "")
            return (f"the trace decided {expr} == {value} on the sample input" + (f" at {where}" if where else "")
                    + ", and the program keeps nothing to check it on another input")
    return ""


def _unbacked(value: Any) -> bool:
    """Whether ``value`` (a node's ``val``: a tensor, a symbolic scalar) depends on the data."""
    if isinstance(value, SYM):
        return bool(value.node.expr.free_symbols) and not value.node.has_hint()
    if isinstance(value, torch.Tensor):
        return any(_unbacked(s) for s in value.shape)
    if isinstance(value, (list, tuple)):
        return any(_unbacked(v) for v in value)
    return False


def needs_values(ep) -> bool:
    """Whether ``ep`` has data-dependent sizes or scalar arguments of tensor operators (which the
    plan fixes to the sample's values: only a trace under :func:`specialising` knows them)."""
    for node in ep.graph.nodes:
        if node.op != "call_function" or node.target is ASSERT or node.target in _DROPPED:
            continue
        if isinstance(node.meta.get("val"), torch.Tensor) and _unbacked(node.meta["val"]):
            return True
        if not isinstance(node.meta.get("val"), SYM) and any(
                isinstance(a.meta.get("val"), SYM) and _unbacked(a.meta["val"]) for a in node.all_input_nodes):
            return True
    return False


@dataclass
class Guard:
    """A condition the program checks where the trace decided it: ``cond`` formatted with the
    program's names of ``roots`` (tensors read whole), the model's line it guards (``node``'s)."""

    cond: str
    roots: list[torch.fx.Node]
    node: torch.fx.Node
    text: str  # the condition in the trace's own symbols (``Ne(u0, 1)``), for the message
    where: str = ""  # ``file:line: code`` where torch decided it (the user's ``if``), if known


def _value(expr: Any, real: dict) -> Any:
    """``expr`` (sympy) evaluated at the sample: a Python int, float or bool."""
    import sympy
    out = sympy.sympify(expr).xreplace(real)
    if out.free_symbols:
        raise BranchError(f"no sample value for the data-dependent expression {expr}")
    if isinstance(out, sympy.logic.boolalg.BooleanAtom):
        return bool(out)
    return int(out) if out.is_integer else float(out)


def render(node: Any, roots: list[torch.fx.Node]) -> str:
    """Python source computing the scalar ``node`` from tensors, ``{i}`` standing for ``roots[i]``
    (appended to as met); constants as literals."""
    if not isinstance(node, torch.fx.Node):
        if isinstance(node, (bool, int, float)) or node is None:
            return repr(node)
        raise BranchError(f"cannot recompute the constant {node!r} of a data-dependent value")
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) or node.op != "call_function":
        if node not in roots:
            roots.append(node)
        return "{%d}" % roots.index(node)
    t, args = node.target, node.args
    if t in (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default):
        return f"{render(args[0], roots)}.item()"
    if t is torch.ops.aten.sym_size.int:
        return f"{render(args[0], roots)}.size({args[1]})"
    if t is torch.ops.aten.sym_numel.default:
        return f"{render(args[0], roots)}.numel()"
    if t in _INFIX:
        return f"({render(args[0], roots)} {_INFIX[t]} {render(args[1], roots)})"
    if t is torch.sym_not:
        return f"(not {render(args[0], roots)})"
    if t is torch.sym_ite:
        return f"({render(args[1], roots)} if {render(args[0], roots)} else {render(args[2], roots)})"
    if t in _CALLS:
        return f"{_CALLS[t]}({', '.join(render(a, roots) for a in args)})"
    raise BranchError(f"cannot recompute the data-dependent value {node.name} = {getattr(t, '__name__', t)}(...) "
                      f"in the generated program")


def _real_values(ep) -> dict:
    """The sample's value of each data-dependent symbol (and of each data-dependent condition
    torch keys by itself, ``Eq(u0, 1)``), as the trace under :func:`specialising` found them."""
    for node in ep.graph.nodes:
        for v in _vals(node.meta.get("val")):
            env = v.node.shape_env
            return dict(getattr(env, "real_tensor_prop_unbacked_vals", None) or {})
    return {}


_SYMBOL = re.compile(r"\b(?:u|zuf|zub)\d+\b")  # torch's names of data-dependent symbols


def _decided_at(ep) -> dict[str, str]:
    """Each data-dependent symbol -> the model's line of the first guard decided on it (the
    assertion node itself carries the line where its values were all computed, which may be a
    caller's: FSMT's ``if not padding_mask.any():`` sits in a helper)."""
    out: dict[str, str] = {}
    for expr, _, where in ep.graph_module.meta.get(DECIDED, ()):
        for s in _SYMBOL.findall(str(expr)):
            if where:
                out.setdefault(s, where)
    return out


def _vals(value: Any) -> list:
    if isinstance(value, SYM):
        return [value]
    if isinstance(value, torch.Tensor):
        return [s for s in value.shape if isinstance(s, torch.SymInt)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _vals(v)]
    return []


def specialise(ep) -> tuple[dict[torch.fx.Node, list[Guard]], set[torch.fx.Node]]:
    """Fix ``ep``'s data-dependent values to the sample's, in place: every scalar node's ``val``
    becomes its value, every tensor of a data-dependent shape a fake tensor of the sample's shape.
    Returns (the guards to check after each node: torch's runtime assertions, and the equality of
    every data-dependent size and of every data-dependent scalar a tensor operator takes; the
    scalar and assertion nodes, which compute nothing of the model's own)."""
    guards: dict[torch.fx.Node, list[Guard]] = {}
    scalars: set[torch.fx.Node] = set()
    if not any(n.target is ASSERT or isinstance(n.meta.get("val"), SYM) or _unbacked(n.meta.get("val"))
               for n in ep.graph.nodes):
        return guards, scalars
    real = _real_values(ep)
    decided_at = _decided_at(ep)
    seen: set[str] = set()
    read: set[torch.fx.Node] = set()  # scalars a tensor operator takes: their sample value is needed

    def add(at: torch.fx.Node, cond: str, roots: list, node: torch.fx.Node, text: str) -> None:
        if text not in seen:  # once per condition on the trace's symbols (``u1 == 4``: each tensor of that size)
            seen.add(text)
            where = next((decided_at[s] for s in _SYMBOL.findall(text) if s in decided_at), "") \
                if node.target is ASSERT else ""
            guards.setdefault(at, []).append(Guard(cond, roots, node, text, where))

    from torch._subclasses.fake_tensor import FakeTensor
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        if node.target is ASSERT:
            roots: list = []
            cond = render(node.args[0], roots)
            said = _SAID.search(str(node.args[1]) if len(node.args) > 1 else "")  # torch's own wording
            if roots:  # (a condition on no tensor is decided already)
                add(node, cond, roots, node, said.group(1) if said else cond.format(*(r.name for r in roots)))
            scalars.add(node)
            continue
        if node.target in _DROPPED or isinstance(val, SYM):
            scalars.add(node)
            continue
        # a tensor operator: its data-dependent scalar arguments and sizes are fixed to the sample's
        for a in node.all_input_nodes:
            v = a.meta.get("val")
            if isinstance(v, SYM) and _unbacked(v):
                read.add(a)
                roots = []
                cond = render(a, roots)
                expect = _value(v.node.expr, real)
                add(a, f"({cond} == {expect!r})", roots, a, f"{v.node.expr} == {expect!r}")
        if isinstance(val, torch.Tensor) and _unbacked(val):
            shape = []
            for d, s in enumerate(val.shape):
                if isinstance(s, torch.SymInt) and _unbacked(s):
                    expect = _value(s.node.expr, real)
                    add(node, f"({{0}}.size({d}) == {expect})", [node], node, f"{s.node.expr} == {expect}")
                    shape.append(expect)
                else:
                    shape.append(int(s))
            mode = val.fake_mode if isinstance(val, FakeTensor) else None
            with (mode if mode is not None else contextlib.nullcontext()):
                node.meta["val"] = torch.empty(shape, dtype=val.dtype, device=val.device)
        elif isinstance(val, (list, tuple)) and _unbacked(val):
            raise BranchError(f"{node.name}: a data-dependent list of tensors is not supported")
    for node in read:  # a tensor operator's scalar argument becomes its sample value
        node.meta["val"] = _value(node.meta["val"].node.expr, real)
    return guards, scalars
