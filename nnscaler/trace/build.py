"""``trace``: a model and sample inputs -> :class:`~nnscaler.ir.graph.IRGraph`, every operator
annotated from the one registry (rules first, then fixed entries)."""
from __future__ import annotations

import operator
import re
from pathlib import Path
import warnings
from typing import Any, Mapping, Protocol, Sequence

import torch
import torch.fx
from torch.export.graph_signature import InputKind, OutputKind

from ..ir.graph import ACTIVATION, BUFFER, CONSTANT, GUARD, INPUT, PARAM, IRGraph, IROp, IRTensor
from .writes import buffer_writes, watch_attributes
from ..ops.registry import DEFAULT_REGISTRY, OpRegistry
from ..ops.rules import OpCall, TensorMeta
from .calls import call_of, flatten_tensor_lists, meta_of
from .checkpoints import checkpoint_of
from .export import NO_GRAD, SET_GRAD_ENABLED, TraceError, export_model
from .arange_index import per_row_index
from .branches import BranchError, Guard, specialise
from .heads import heads_outer
from .rows import batch_major_rows
from .strided import dense_as_strided
from .match import derive

_KINDS = {InputKind.PARAMETER: PARAM, InputKind.BUFFER: BUFFER, InputKind.USER_INPUT: INPUT,
          InputKind.CONSTANT_TENSOR: CONSTANT}



def _without_weights(ep):
    """``ep`` holding meta tensors in place of the model's parameters and buffers: the graph keeps the exported
    program for its structure (casts, saved tensors: :mod:`nnscaler.compile.precision`, :mod:`nnscaler.cost.saved`),
    and the compiled module keeps the graph; holding the model's own weights there kept the whole unsharded model
    alive on every rank for the module's lifetime (measured: the fp32 weights of Llama-3 8B, 30 GiB a rank under
    ZeRO 3, ``bench/results/real_memory.md``). Nothing reads the values after the trace."""
    def meta(v):
        m = torch.empty_like(v, device="meta")
        return torch.nn.Parameter(m, requires_grad=v.requires_grad) if isinstance(v, torch.nn.Parameter) else m
    ep._state_dict = {k: meta(v) if isinstance(v, torch.Tensor) else v for k, v in ep.state_dict.items()}
    return ep


class Tracer(Protocol):
    """What ``parallelize`` traces a model with: :func:`trace`'s signature."""

    def __call__(self, model: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None, *,
                 registry: OpRegistry | None = None, strict: bool = False) -> IRGraph: ...


class UnknownOperatorWarning(UserWarning):
    """Operators the registry does not know: they are replicated."""


class SpecialisedBranchWarning(UserWarning):
    """The model branches on (or sizes a tensor by) its data: the program is traced for the sample
    input's branch and size at the lines named, and checks them at run time."""


READS_STRIDES = ("aten.as_strided.default",)
"""Operators whose result depends on their input's strides, not only its values: traced on a non-contiguous
view they are refused (the program's copy of that tensor is laid out otherwise: Longformer's sliding chunks)."""


def _source(node: torch.fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)', trace)
    if not frames:
        return ""
    torch_dir = str(Path(torch.__file__).parent)
    own = [f for f in frames if not f[0].startswith(torch_dir)]
    path, line, code = (own or frames)[-1]  # the model's line (transformers' too), not torch's
    return f"{path}:{line}: {code.strip()}"


def _scope(node: torch.fx.Node) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The modules ``node`` ran in, outermost first, and their class names (from ``nn_module_stack``);
    the root module (path ``""``) left out."""
    stack = [v for v in (node.meta.get("nn_module_stack") or {}).values() if isinstance(v, tuple) and v[0]]
    return tuple(str(v[0]) for v in stack), tuple(str(v[1]).rpartition(".")[2] for v in stack)


def _tensor(node: torch.fx.Node, kind: str, target: str = "") -> IRTensor | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return IRTensor(node.name, tuple(int(s) for s in val.shape), val.dtype, kind, target)


def trace(model: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None, *,
          registry: OpRegistry | None = None, strict: bool = False) -> IRGraph:
    """Export ``model`` on the sample arguments and annotate every operator.

    Operators the registry does not know are replicated and named, once each, in an
    :class:`UnknownOperatorWarning`; with ``strict=True`` they are a :class:`TraceError`. Buffers
    forward writes in place become ``graph.writes`` (a parameter written is a TraceError); Python
    attributes it writes are named in a :class:`~.writes.FrozenAttributeWarning`.
    """
    registry = DEFAULT_REGISTRY if registry is None else registry
    with watch_attributes(model):  # Python attributes forward writes: named in a FrozenAttributeWarning
        ep = export_model(model, args, kwargs, registry.module_rewrites())
    try:  # data-dependent branches and sizes: fixed to the sample's, each a guard checked at run time
        guards, scalars = specialise(ep)
    except BranchError as exc:
        raise TraceError(f"torch.export traced {type(model).__name__} on data-dependent values: {exc}") from None
    rewrites = batch_major_rows(ep.graph)  # rows merged batch-second (nn.MultiheadAttention): batch first
    rewrites += heads_outer(ep.graph)  # heads merged into the batch (nn.MultiheadAttention): a dim of their own
    rewrites += per_row_index(ep.graph)  # x[arange(B)[:, None..], j] (transformers' masks): a per-row lookup
    rewrites += dense_as_strided(ep.graph)  # as_strided of a transposed view (Longformer): of a contiguous copy
    if rewrites:
        ep.graph_module.recompile()
    kinds = {s.arg.name: (_KINDS.get(s.kind, CONSTANT), s.target or "") for s in ep.graph_signature.input_specs
             if hasattr(s.arg, "name")}
    ins, params, buffers, ops = [], [], [], []
    cut: dict[IRTensor, IRTensor] = {}  # a no_grad region's tensor -> its detached copy (see visit's read)
    specialised: list[str] = []  # the model's lines each guard checks

    def visit(graph: torch.fx.Graph, env: dict, prefix: str = "") -> list:
        """Turn ``graph``'s nodes into IR; returns its outputs. Regions under a grad-mode switch are
        inlined (their values do not depend on the mode)."""
        def value(a: Any) -> Any:
            if isinstance(a, torch.fx.Node):
                return env.get(a)
            if isinstance(a, (list, tuple)):
                return type(a)(value(x) for x in a)
            return meta_of(a) if isinstance(a, torch.SymInt) else a

        def read(a: Any) -> Any:
            """:func:`value`, a tensor of an inlined ``torch.no_grad()`` region (``meta[NO_GRAD]``)
            read outside it detached, as on one device."""
            if isinstance(a, torch.fx.Node):
                t = env.get(a)
                if a.meta.get(NO_GRAD) and isinstance(t, IRTensor) and (t.dtype.is_floating_point or t.dtype.is_complex):
                    if t not in cut:
                        cut[t] = detached(t, f"{prefix}{a.name}")
                    return cut[t]
                return t
            if isinstance(a, (list, tuple)):
                return type(a)(read(x) for x in a)
            return value(a)

        for node in graph.nodes:
            if node in scalars:  # a data-dependent scalar or torch's runtime assertion: a guard checks it
                env[node] = node.meta.get("val")
            elif node.op == "placeholder" and not prefix:
                kind, target = kinds.get(node.name, (INPUT, ""))
                t = _tensor(node, kind, target)
                env[node] = t if t is not None else node.meta.get("val")
                if t is not None:
                    {PARAM: params, BUFFER: buffers}.get(kind, ins).append(t)
            elif node.op == "get_attr":
                env[node] = getattr(ep.graph_module, node.target, None)
            elif node.op == "call_function" and node.target is operator.getitem:
                env[node] = value(node.args[0])[node.args[1]]
            elif node.op == "call_function" and node.target is SET_GRAD_ENABLED:
                sub = env[node.args[1]]
                sub_env = dict(zip([n for n in sub.graph.nodes if n.op == "placeholder"], value(node.args[2:])))
                outs = visit(sub.graph, sub_env, f"{prefix}{node.name}_")
                if not node.args[0]:  # a torch.no_grad() region: its results carry no gradient, as on one device
                    outs = [detached(t, f"{prefix}{node.name}_{i}") if isinstance(t, IRTensor) else t
                            for i, t in enumerate(outs)]
                env[node] = outs
            elif node.op == "call_function":
                env[node] = add_op(node, value if node.meta.get(NO_GRAD) else read, prefix)
            elif node.op == "output":  # at the top: (as computed, as read outside a no_grad region) per output
                return [(value(a), lambda a=a: read(a)) for a in node.args[0]] if not prefix else list(value(node.args[0]))
            for g in guards.get(node, ()) if not prefix else ():
                add_guard(g, env)
        return []

    def add_guard(g: Guard, env: dict) -> None:
        """The check of ``g`` in the program: its tensors read whole, one line raised on failure."""
        roots = [env.get(r) for r in g.roots]
        if not all(isinstance(t, IRTensor) for t in roots):
            raise TraceError(f"{type(model).__name__}: a data-dependent value at {_source(g.node)} is computed "
                             f"from something other than the model's tensors; it cannot be checked at run time")
        where = g.where or _source(g.node) or g.node.name
        path, _, code = where.partition(": ")
        on_state = not any(reads_input(t) for t in roots)
        message = (f"{type(model).__name__}: data-dependent branch or size at {path}" + (f" ({code})" if code else "")
                   + (f": the program was traced for a model state where {g.text} held, and the state now breaks it"
                      if on_state else f": the program was traced for an input where {g.text} held, and this input "
                      f"breaks it (trace on an input of this kind, or write the branch with torch.where or torch.cond)"))
        op = IROp(f"guard_{len(specialised)}", GUARD, roots, [None],
                  {"cond": g.cond, "message": message, "on_state": on_state, "text": g.text}, source=where)
        op.scope, op.scope_types = _scope(g.node)
        for t in roots:
            t.consumers.append(op)
        ops.append(op)
        specialised.append(where)

    def reads_input(t: IRTensor) -> bool:
        """Whether ``t`` is computed from a model input (a guard on it is on data; otherwise on the
        model's state alone: parameters, buffers, constants)."""
        seen, stack = set(), [t]
        while stack:
            x = stack.pop()
            if id(x) in seen:
                continue
            seen.add(id(x))
            if x.kind == INPUT:
                return True
            if x.producer is not None:
                stack += [i for i in x.producer.tensor_inputs() if isinstance(i, IRTensor)]
        return False

    def detached(t: IRTensor, name: str) -> IRTensor:
        """``t.detach()`` as an operator of the graph: the end of a region run without gradients,
        which the graph inlines (its values do not depend on the mode, its gradients do)."""
        meta = TensorMeta(t.shape, t.dtype)
        call = OpCall("aten.detach.default", (meta,), {}, (meta,))
        found = derive(call, registry)
        out = IRTensor(f"{name}_detached", t.shape, t.dtype, ACTIVATION)
        op = IROp(out.name, call.overload, [t], [out], spec=found[0] if found else None,
                  bound=found[1] if found else None, source="the end of a torch.no_grad() region")
        t.consumers.append(op)
        out.producer = op
        ops.append(op)
        return out

    def add_op(node: torch.fx.Node, value, prefix: str):
        call = call_of(node)
        src = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], torch.fx.Node) else None
        if call.overload in READS_STRIDES and isinstance(src, torch.Tensor) and not src.is_contiguous():
            raise TraceError(f"{type(model).__name__}: {call.overload} at {_source(node)} reads the storage of a "
                             f"non-contiguous view (strides {tuple(src.stride())}); a parallel program holds that tensor "
                             f"in another layout (gathered, or split), so it would read other elements: make the view "
                             f"contiguous first (.contiguous()) or write it without as_strided")
        found = derive(call, registry)
        val = node.meta.get("val")
        metas = list(val) if isinstance(val, (list, tuple)) else [val]
        name = prefix + node.name
        outs = [IRTensor(f"{name}_{i}" if len(metas) > 1 else name, tuple(int(s) for s in m.shape),
                         m.dtype, ACTIVATION) if isinstance(m, torch.Tensor) else None
                for i, m in enumerate(metas)]
        args = [value(a) for a in node.args]
        op = IROp(name, call.overload, flatten_tensor_lists(args) if found else args, outs,
                  {k: value(v) for k, v in node.kwargs.items()},
                  spec=found[0] if found else None, bound=found[1] if found else None, source=_source(node))
        op.scope, op.scope_types = _scope(node)
        op.checkpoint = checkpoint_of(node)  # a torch.utils.checkpoint call of the model: recomputed alike
        op.sequence = isinstance(val, (list, tuple))
        for t in op.tensor_inputs():
            t.consumers.append(op)
        for t in outs:
            if t is not None:
                t.producer = op
        ops.append(op)
        return outs if isinstance(val, (list, tuple)) else outs[0]

    pairs = visit(ep.graph, {})
    # a buffer's new value as computed (written in the layout it is held in: reduced there, if partial)
    writes = buffer_writes(model, ep.graph_signature.output_specs, [v for v, _ in pairs], buffers)
    user = [i for i, s in enumerate(ep.graph_signature.output_specs) if s.kind == OutputKind.USER_OUTPUT]
    outputs = [pairs[i][1]() for i in user]  # a buffer's functionalized update is not a model output
    constants = [t for t in ins if t.kind == CONSTANT]
    ins = [t for t in ins if t.kind != CONSTANT]
    graph = IRGraph(ops, ins, params, buffers + constants, outputs,
                    {t.target: ep.constants[t.target] for t in constants if t.target in ep.constants},
                    exported=_without_weights(ep), writes=writes)
    if specialised:
        lines = list(dict.fromkeys(specialised))
        warnings.warn(f"{type(model).__name__} branches on or sizes tensors by its data: traced for the sample "
                      f"input there, and {len(specialised)} guards check it at run time: " + "; ".join(lines),
                      SpecialisedBranchWarning, stacklevel=2)
    unknown = graph.unknown()
    if unknown:
        msg = (f"{len(unknown)} operators of {type(model).__name__} have no annotation and will be replicated: "
               f"{graph.unknown_summary()}")
        if strict:
            raise TraceError(msg + "; register them with nnscaler.register_op or pass strict=False")
        warnings.warn(msg, UnknownOperatorWarning, stacklevel=2)
    return graph
