"""One readable Python module per plan rank: plain torch calls, collectives between layouts, a
comment on each operator pointing back to the model's source line."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..comm.conversion import Step, conversion, step_layout
from ..dimops.layout import Layout, Partial, Replicate, Shard, layout_str, piece
from ..dimops.partition import axis_groups, coords, local_sizes
from ..ir.graph import BUFFER, CONSTANT, GUARD, PARAM, BufferWrite, IRGraph, IROp, IRTensor
from ..ops.registry import DEFAULT_REGISTRY
from ..ops.spec import resolve
from ..trace.amp import converts_to
from ..ir.plan import Plan
from .coalesce import FORWARD_KINDS, Candidate, schedule
from .probe import conversion_info, held_grad_layout, use_grad_layout
from .frees import free_dead
from .recompute import wrap
from .render import CodegenError, Raw, callable_source, comment, literal


@dataclass(frozen=True)
class StateShard:
    """The piece of one parameter, buffer or constant a rank holds: ``(start, stop)`` per dim."""

    name: str
    kind: str
    full_shape: tuple[int, ...]
    layout: tuple[str, ...]
    slices: tuple[tuple[int, int], ...]
    sync_axis: int | None = None  # mesh axis its gradient is summed over after backward


def stored_layouts(graph: IRGraph, plan: Plan) -> dict[IRTensor, Layout]:
    """Where every parameter, buffer and constant lives: split as its first consumer wants it, a
    partial value or a split in the balanced order of context parallelism taken whole (the program
    makes the partial value, or cuts the balanced pieces, on use)."""
    whole = tuple(Replicate() for _ in plan.mesh_shape)
    out: dict[IRTensor, Layout] = {}
    for op in graph.ops:
        lay = _layout(op, plan)
        for i, x in enumerate(op.inputs):
            if isinstance(x, IRTensor) and x.kind in (PARAM, BUFFER, CONSTANT) and x not in out:
                want = lay.inputs[i] if lay is not None and i < len(lay.inputs) and lay.inputs[i] is not None else whole
                out[x] = tuple(Replicate() if isinstance(q, Partial) or getattr(q, "balanced", False) else q
                               for q in want)
    for t in graph.params + graph.buffers:
        out.setdefault(t, whole)
    for t in out if plan.held else ():  # held where the plan says (a respecialised program: its predecessor's pieces)
        lay = plan.held.get(t.target or t.name)
        if lay is not None:
            out[t] = tuple(Shard.parse(q) if q.startswith("D") else Replicate() for q in lay)
    return out


def _layout(op: IROp, plan: Plan):
    return op.layout(plan.partition(op)) if op.known else None


def synced_params(graph: IRGraph, plan: Plan) -> dict[IRTensor, int]:
    """Parameters whose gradient is summed once, in buckets after backward, rather than at every use:
    held whole on exactly one mesh axis along which every consumer splits its work (the gradient
    each rank gets is then partial on that axis and nothing else). Value: that axis."""
    star: dict[IRTensor, set[int]] = {}
    other: set[IRTensor] = set()
    for op in graph.ops:
        lay = _layout(op, plan)
        # a parameter read inside a list (or keyword) argument of an op with no annotation is read
        # whole there, with a whole gradient: it is no partial sum to add up after backward
        positional = {id(x) for x in op.inputs if isinstance(x, IRTensor)}
        other.update(x for x in op.tensor_inputs() if x.kind == PARAM and id(x) not in positional)
        for i, x in enumerate(op.inputs):
            if not (isinstance(x, IRTensor) and x.kind == PARAM):
                continue
            if lay is None or i >= len(lay.inputs) or lay.inputs[i] is None:
                other.add(x)
                continue
            axes = {a for a, (q, ident) in enumerate(zip(lay.inputs[i], plan.partition(op).axis_ids))
                    if isinstance(q, Replicate) and ident is not None}
            if x in star and star[x] != axes:
                other.add(x)
            star.setdefault(x, axes)
    held = stored_layouts(graph, plan) if plan.held else {}  # one held split on the axis: its reads sum the gradient
    return {t: next(iter(axes)) for t, axes in star.items() if len(axes) == 1 and t not in other
            and isinstance(held.get(t, (Replicate(),) * len(plan.mesh_shape))[next(iter(axes))], Replicate)}


def shard_slices(shape: tuple[int, ...], layout: Layout, mesh_shape: tuple[int, ...], rank: int) -> tuple:
    """``(start, stop)`` per dim of the piece a rank holds under ``layout`` (``(start, stop, blocks)``
    for a dim split in blocks): axes in order, each splitting the range the lower axes left (the
    nesting convention of :mod:`nnscaler.comm.conversion`)."""
    return piece(shape, layout, mesh_shape, coords(rank, mesh_shape))


class Emitter:
    """One plan rank's program as it is emitted: its lines, imports, state shards and the conversion
    ``steps`` between layouts (which the cost model reads: the program is emitted once per plan)."""

    def __init__(self, graph: IRGraph, plan: Plan, rank: int, probe: bool = False, recompute: str = "none",
                 recompute_modules=None, groups=()):
        self.graph, self.plan, self.rank, self.probe = graph, plan, rank, probe
        self.recompute, self.recompute_modules = recompute, recompute_modules  # see codegen/recompute.py
        self.spans: list[tuple[IROp, int, int]] = []  # each operator's lines (its conversions included)
        self.lines: list[str] = []
        self.imports: set[str] = set()
        self.layouts: dict[IRTensor, Layout] = {}
        self.var: dict[IRTensor, str] = {}
        self.cache: dict[tuple, str] = {}
        # (tensor, steps taken from its layout) -> (variable, layout): a reader whose chain of steps
        # starts with an earlier reader's goes on from there (the embedding's all-reduce made once for
        # the residual add, read whole, and the column-parallel projection, whose chain adds the
        # backward all-reduce of Megatron's f); the instrumented mode keeps one chain per reader
        self.taken: dict[tuple, tuple[str, Layout]] = {}
        self.fresh = 0
        self.collectives = 0
        self.steps: list[tuple[IRTensor, Layout, Step]] = []  # (tensor, its layout before, step): the cost model reads them
        self.readers: list[IROp | None] = []  # per step, the operator it feeds (None: an output or a buffer write)
        self.reader: IROp | None = None
        self.synced = synced_params(graph, plan)
        self.grads = graph.carries_grad()  # tensors whose conversions need backward collectives
        self.shards: list[StateShard] = []
        self.chain_of: dict[str, str] = {}  # instrumented mode: a converted variable -> its conversion chain
        self.uses = 0  # instrumented mode: tensors read so far by the operator being emitted
        self.converted: dict[IRTensor, torch.dtype] = {}  # bf16-mixed: tensors a dropped dtype assert converts
        # coalescing (codegen/coalesce.py): the all-reduces starting a chain; per operator reading a
        # tensor through a forward collective (new or taken), the operators that issued them; the same
        # per cache key and taken chain (the last one); each (tensor, step) of a group -> its group
        self.candidates: list[Candidate] = []
        self.through: dict[IROp, list[IROp]] = {}
        self.origin: dict[tuple, IROp] = {}
        self.group_of = {m: g for g in groups for m in g}

    def fetch(self, t: IRTensor, want: Layout, axis_ids) -> str:
        """The variable holding ``t`` in layout ``want`` for a consumer splitting ``axis_ids``."""
        key = (t, want, tuple(axis_ids))
        if key in self.cache:
            self._through(self.origin.get(key))
            return self.cache[key]
        steps, _ = conversion(self.layouts[t], want, axis_ids, self.plan.mesh_shape, t.shape, t in self.grads)
        if t in self.synced:  # its gradient is summed in buckets after backward instead
            sync = self.synced[t]
            steps = [replace(st, kind="all_gather")
                     if st.kind == "all_gather_sum_grad" and st.axis == sync else st
                     for st in steps if not (st.kind == "grad_all_reduce" and st.axis == sync)]
        if steps and (t, steps[0]) in self.group_of and (t, (steps[0],)) not in self.taken:
            self._coalesced(self.group_of[(t, steps[0])])
        name, cur = self.var[t], self.layouts[t]
        chain = ""
        done = 0
        if not self.probe:  # start from the longest chain of steps an earlier reader already took
            done = next((k for k in range(len(steps), 0, -1) if (t, tuple(steps[:k])) in self.taken), 0)
            if done:
                name, cur = self.taken[(t, tuple(steps[:done]))]
        origin = self.origin.get((t, tuple(steps[:done])))  # where the taken part's last collective was issued
        if self.probe:  # the chain's own alias of its source: the gradient back through this chain alone
            chain = f"{t.name}#{len(self.chain_of) + 1}"
            sync = self.synced.get(t)
            info = conversion_info(cur, want, axis_ids, steps, sync)
            self.fresh += 1
            src = f"{t.name}__{self.fresh}"
            self.lines.append(f"    {src} = probe.conversion({chain!r}, {t.name!r}, {name}, {layout_str(cur)!r}, "
                              f"{held_grad_layout(cur, self.plan.mesh_shape, sync)!r}, {literal(info)})")
            name = src
        for k, step in enumerate(steps[done:], done + 1):
            if k == 1 and step.kind == "all_reduce" and self.reader is not None and not self.probe:
                self.candidates.append(Candidate(t, step, self.reader))
            self.steps.append((t, cur, step))
            self.readers.append(self.reader)
            cur = step_layout(cur, step)
            self.fresh += 1
            new = f"{t.name}__{self.fresh}"
            self.lines.append(f"    {new} = {step.code(name, f'g[{step.axis}]')}")
            self.collectives += step.kind not in ("split", "to_partial")
            name = new
            self.taken[(t, tuple(steps[:k]))] = (name, cur)
            if step.kind in FORWARD_KINDS:
                origin = self.reader
            if origin is not None:
                self.origin[(t, tuple(steps[:k]))] = origin
        self.cache[key] = name
        if origin is not None:
            self.origin[key] = origin
        self._through(origin)
        if self.probe:
            self.chain_of[name] = chain
        return name

    def _through(self, origin: IROp | None) -> None:
        """The operator being emitted reads a tensor whose last forward collective ``origin`` issued."""
        if origin is not None and self.reader is not None:
            self.through.setdefault(self.reader, []).append(origin)

    def _coalesced(self, group) -> None:
        """One ``C.all_reduce_coalesced`` for the members of ``group`` (each a tensor and the
        all-reduce starting its chain) not summed yet, taken as those chains' first steps; the later
        members' steps marked ``coalesced`` (they ride in the first one's collective)."""
        members = [(t, st) for t, st in group if t in self.layouts and (t, (st,)) not in self.taken]
        if len(members) < 2:
            return
        news = []
        for i, (t, st) in enumerate(members):
            self.steps.append((t, self.layouts[t], replace(st, coalesced=True) if i else st))
            self.readers.append(self.reader)
            self.fresh += 1
            news.append(f"{t.name}__{self.fresh}")
            self.taken[(t, (st,))] = (news[-1], step_layout(self.layouts[t], st))
            if self.reader is not None:
                self.origin[(t, (st,))] = self.reader
        names = ", ".join(self.var[t] for t, _ in members)
        self.lines.append(f"    {', '.join(news)}, = C.all_reduce_coalesced([{names}], g[{members[0][1].axis}])")
        self.collectives += 1

    def read(self, reader: str, t: IRTensor, want: Layout, axis_ids) -> str:
        """:meth:`fetch`, and in instrumented mode the use handed to ``probe.use`` (``reader``: the
        consuming operator's name, or ``"output"``)."""
        name = self.fetch(t, want, axis_ids)
        if not self.probe:
            return name
        self.fresh += 1
        new = f"{t.name}__{self.fresh}"
        grad = use_grad_layout(want, axis_ids, self.plan.mesh_shape)
        self.lines.append(f"    {new} = probe.use({reader!r}, {self.uses}, {t.name!r}, {name}, {layout_str(want)!r}, "
                          f"{grad!r}, {self.chain_of[name]!r})")
        self.uses += 1
        return new

    def name_of(self, fn, spec) -> tuple[str, dict]:
        try:
            expr, bound_kwargs, module = callable_source(fn)
        except CodegenError:
            if spec.name in DEFAULT_REGISTRY and DEFAULT_REGISTRY.get(spec.name) is spec:
                self.imports.add("from nnscaler.runtime.program import registered")
                attr = "local" if fn is spec.local else "fn"
                return f"registered({spec.name!r}).{attr}", {}
            raise
        if module:
            self.imports.add(f"import {module}")
        return expr, bound_kwargs

    def cast(self, name: str, t: IRTensor, dtype) -> str:
        """``name`` (holding ``t``) cast to ``dtype`` for an operator autocast casts (bf16-mixed, see
        :mod:`nnscaler.runtime.precision`); a parameter's cast is made once, as autocast caches it.
        An operator autocast leaves alone reads a tensor the model converted earlier (``x.float()``,
        a no-op in the fp32 trace, which kept only a dtype assert) converted as the model has it."""
        if dtype in (None, "autocast") and t in self.converted:
            self.fresh += 1
            new = f"{t.name}__{self.fresh}"
            self.lines.append(f"    {new} = {name}.to({self.converted[t]})  # as the model converts it")
            return new
        if dtype is None or dtype == "autocast" or not t.dtype.is_floating_point or t.dtype == torch.float64:
            return name
        key = ("cast", name, str(dtype))
        if t.kind == PARAM and key in self.cache:
            return self.cache[key]
        self.fresh += 1
        new = f"{t.name}__{self.fresh}"
        self.lines.append(f"    {new} = {name}.to({dtype})  # as autocast casts it")
        if t.kind == PARAM:
            self.cache[key] = new
        return new

    def op(self, op: IROp) -> None:
        start = len(self.lines)
        self.reader = op
        self._op(op)
        self.reader = None
        self.spans.append((op, start, len(self.lines)))

    def _op(self, op: IROp) -> None:
        self.uses = 0
        if op.cast == "drop":
            # the model's .to(dtype) there: under bf16-mixed a real conversion for the operators after it
            x, dtype = op.inputs[0], converts_to(op.overload, op.inputs, op.kwargs)
            if isinstance(x, IRTensor) and dtype is not None:
                self.converted[x] = dtype
            self.lines.append(f"    # {op.name}: an assert of the fp32 trace's dtype, dropped under bf16-mixed")
            return
        if op.source:
            self.lines.append(f"    # {comment(op.source)}")
        if op.overload == GUARD:
            self._guard(op)
            return
        outs = [self.var.setdefault(t, t.name) if t is not None else "_" for t in op.outputs]
        target = ", ".join(outs) + ("," if len(outs) == 1 and (len(op.outputs) > 1 or op.sequence) else "")
        new = (lambda x: op.literals.get(x, x) if isinstance(x, float) else x) if op.literals else (lambda x: x)  # noqa: E731
        inputs, op_kwargs = [new(x) for x in op.inputs], {k: new(v) for k, v in op.kwargs.items()}  # bf16's extremes
        if not op.known:
            whole = tuple(Replicate() for _ in self.plan.mesh_shape)
            none = tuple(None for _ in self.plan.mesh_shape)
            get = lambda t: self.cast(self.read(op.name, t, whole, none), t, op.cast)  # noqa: E731
            args = [self._arg(x, get) for x in inputs]
            kwargs = [f"{k}={self._arg(v, get)}" for k, v in op_kwargs.items()]
            fn = f"torch.ops.{op.overload}" if not op.overload.startswith("_operator") else op.overload
            self.lines.append(f"    {target} = {self._autocast(op, fn, args + kwargs)}  # replicated: no annotation")
            for t in op.outputs:
                if t is not None:
                    self.layouts[t] = whole
            self._probe(op)
            return
        spec, p = op.spec, self.plan.partition(op)
        lay = _layout(op, self.plan)
        sizes = local_sizes(op.bound, p)
        rows = self.plan.over_replicas.get(op.name)  # run on every replica's rows: the batch R times longer
        if rows is not None:
            sizes[rows] *= self.plan.replicas
        args = []
        for i, x in enumerate(inputs[:len(spec.anno.inputs)]):
            if spec.anno.inputs[i].opaque:
                args.append(literal(new(resolve(spec.args[i], sizes)) if i in spec.args else x))
            else:
                args.append(self.cast(self.read(op.name, x, lay.inputs[i], p.axis_ids), x, op.cast)
                            if isinstance(x, IRTensor) else self.fetch(x, lay.inputs[i], p.axis_ids))
        fn = spec.local or spec.fn
        expr, kw = self.name_of(fn, spec)
        kw.update({k: new(v) for k, v in resolve(dict(spec.kwargs), sizes).items()})
        for k, v in kw.items():
            if callable(v) and not isinstance(v, type):
                kw[k] = Raw(self.name_of(v, spec)[0])
        if spec.local is not None:
            args.insert(0, self._shard(op, p))
        kwargs = [f"{k}={literal(v)}" for k, v in kw.items()]
        if rows is not None:
            expr, args, kwargs = self._over_replicas(op, rows, expr, args, kwargs, spec.local is not None)
        call = self._autocast(op, expr, args + kwargs)
        layouts = ", ".join(layout_str(q) for q in lay.outputs)
        self.lines.append(f"    {target} = {call}  # {p.label} -> {layouts}")
        for t, q in zip(op.outputs, lay.outputs):
            if t is not None:
                self.layouts[t] = q
        self._probe(op)

    def _over_replicas(self, op: IROp, ident: str, expr: str, args: list[str], kwargs: list[str], shard: bool):
        """The call of ``op`` on every data-parallel replica's rows (``ident``'s dim of each input gathered
        over the replicas, its own rows of each output kept): :func:`nnscaler.runtime.replica_rows.over_replicas`."""
        self.imports.add("from nnscaler.runtime.replica_rows import over_replicas")
        row = lambda dims: next((d for d, ids in enumerate(dims or ()) if ids == (ident,)), None)  # noqa: E731
        ins = [None] * shard + [row(dims) if isinstance(x, IRTensor) else None
                                for x, dims in zip(op.inputs, op.bound.inputs)][:len(args) - shard]
        outs = tuple(row(dims) for dims in op.bound.outputs)
        return "over_replicas", [expr, literal(tuple(ins)), literal(outs), *args], kwargs

    def _guard(self, op: IROp) -> None:
        """A data-dependent branch or size the trace fixed (``nnscaler/trace/branches.py``), checked
        on the whole tensors (:func:`nnscaler.runtime.program.guard`, where torch.export left its
        ``aten._assert_scalar``): every rank of the plan computes the same condition and raises alike
        (a :class:`~nnscaler.runtime.program.GuardFailed`; one on the model's state alone makes
        :class:`~nnscaler.runtime.module.ParallelModule` respecialise the program)."""
        whole = tuple(Replicate() for _ in self.plan.mesh_shape)
        none = tuple(None for _ in self.plan.mesh_shape)
        names = [self.read(op.name, t, whole, none) for t in op.inputs]
        self.imports.add("from nnscaler.runtime.program import guard")
        on_state = bool(op.kwargs.get("on_state", False))
        self.lines.append(f"    guard({op.kwargs['cond'].format(*names)}, {literal(op.name)}, {literal(op.source)}, "
                          f"{literal(op.kwargs.get('text', ''))}, {literal(op.kwargs['message'])}, on_state={on_state})"
                          f"  # data-dependent ({'state' if on_state else 'data'}): checked whole")

    def write(self, w: BufferWrite) -> None:
        """Write the buffer forward wrote in place (``w``), after every operator: its new value
        converted to the layout the buffer is held in (a partial value, such as a statistic of a
        batch split over ranks, reduced first: every rank writes the single-device value)."""
        none = tuple(None for _ in self.plan.mesh_shape)
        name = self.fetch(w.value, self.layouts[w.buffer], none)
        self.imports.add("from nnscaler.runtime.program import write_buffer")
        if w.source:
            self.lines.append(f"    # {comment(w.source)}")
        self.lines.append(f"    write_buffer(p[{w.buffer.target or w.buffer.name!r}], {name})  # "
                          f"buffer written in forward, held {layout_str(self.layouts[w.buffer])}")

    def _autocast(self, op: IROp, fn: str, args: list[str]) -> str:
        """The call of ``fn``; for an operator bf16-mixed runs under autocast (a custom operator,
        :func:`nnscaler.runtime.precision.autocast_run`), through that."""
        if op.cast != "autocast":
            return f"{fn}({', '.join(args)})"
        self.imports.add("from nnscaler.runtime.precision import autocast_run")
        return f"autocast_run({', '.join([fn, *args])})"

    def _probe(self, op: IROp) -> None:
        """In instrumented mode, hand every output to ``probe`` (which records it and returns it)."""
        if not self.probe:
            return
        for t in op.outputs:
            if t is not None and t in self.layouts:
                self.lines.append(f"    {self.var[t]} = probe({op.name!r}, {t.name!r}, {self.var[t]}, "
                                  f"{layout_str(self.layouts[t])!r})")

    def _shard(self, op: IROp, p) -> str:
        self.imports.add("from nnscaler.runtime.partitioned import ShardContext")
        c = coords(self.rank, self.plan.mesh_shape)
        factors = {i: p.factor(i) for i, _ in p.splits if i is not None}  # an identifier on two axes: both
        indices: dict = {}
        for a, (i, f) in enumerate(p.splits):  # nested: the lower axis's chunk, then the higher's inside it
            if i is not None:
                indices[i] = indices.get(i, 0) * f + c[a]
        groups = "{" + ", ".join(f"{i!r}: g[{a}]" for a, (i, _) in enumerate(p.splits) if i is not None) + "}"
        sizes = dict(op.bound.sizes)
        if op.name in self.plan.over_replicas:  # run on every replica's rows
            sizes[self.plan.over_replicas[op.name]] *= self.plan.replicas
        balanced = f", balanced={literal(tuple(p.balanced))}" if p.balanced else ""  # context parallelism's order
        return f"ShardContext({literal(sizes)}, {literal(factors)}, {literal(indices)}, {groups}{balanced})"

    def _arg(self, x: Any, fetch) -> str:
        if isinstance(x, IRTensor):
            return fetch(x)
        if isinstance(x, (list, tuple)) and any(isinstance(v, IRTensor) for v in x):
            inner = ", ".join(self._arg(v, fetch) for v in x)
            return f"[{inner}]" if isinstance(x, list) else f"({inner},)"
        return literal(x)


def emit_program(graph: IRGraph, plan: Plan, rank: int, probe: bool = False, recompute: str = "none",
                 recompute_modules=None) -> Emitter:
    """Emit plan rank ``rank``'s body: its lines, conversion ``steps`` and state ``shards``;
    ``recompute``/``recompute_modules`` (``ComputeConfig``'s) wrap regions when it is rendered.
    Independent all-reduces on one axis ready at one point are summed in one collective
    (``nnscaler/codegen/coalesce.py``): the program is emitted once, its operators rescheduled, and
    emitted again; not in the instrumented mode (one chain per reader) nor where regions are
    recomputed (their lines must stay their own)."""
    e = _emit(graph, plan, rank, graph.ops, probe, recompute, recompute_modules)
    if probe or recompute != "none" or any(op.checkpoint is not None for op in graph.ops):
        return e
    order, groups = schedule(graph.ops, e.candidates, e.through)
    return _emit(graph, plan, rank, order, probe, recompute, recompute_modules, groups) if groups else e


def _emit(graph: IRGraph, plan: Plan, rank: int, ops: list[IROp], probe: bool, recompute: str, recompute_modules,
          groups=()) -> Emitter:
    """One emission of the program, its operators in ``ops``' order, ``groups`` summed together."""
    e = Emitter(graph, plan, rank, probe, recompute, recompute_modules, groups)
    stored = stored_layouts(graph, plan)
    shards = e.shards
    for t, lay in stored.items():
        e.layouts[t] = lay
        e.var[t] = f"p[{t.target or t.name!r}]"
        shards.append(StateShard(t.target or t.name, t.kind, t.shape, tuple(str(q) for q in lay),
                                 shard_slices(t.shape, lay, plan.mesh_shape, rank), e.synced.get(t)))
    whole = tuple(Replicate() for _ in plan.mesh_shape)
    for t in graph.inputs:
        e.layouts[t], e.var[t] = whole, t.name
    for w in graph.writes:  # read as forward found it: the write at the end would change what backward saved
        e.var[w.buffer] = f"{w.buffer.name}__in"
        e.lines.append(f"    {w.buffer.name}__in = p[{w.buffer.target or w.buffer.name!r}].clone()  # written in forward")
    for op in ops:
        e.op(op)
    none = tuple(None for _ in plan.mesh_shape)
    e.uses = 0
    for w in graph.writes if not probe else ():  # the buffers forward wrote in place, each in its held layout
        e.write(w)  # (the instrumented program compares tensors, its state is a copy: it writes none)
    outs = [e._arg(o, lambda t: e.read("output", t, whole, none)) for o in graph.outputs]
    e.lines.append(f"    return {outs[0] if len(outs) == 1 else '(' + ', '.join(outs) + ',)'}")
    return e


def conversion_steps(graph: IRGraph, plan: Plan, rank: int = 0, tensors: bool = False) -> list[tuple]:
    """Every step plan rank ``rank``'s program takes between layouts, in order, each with whether
    the tensor it moves carries a gradient (so its backward collective runs) and, with ``tensors``,
    that tensor."""
    e = emit_program(graph, plan, rank)
    return [(step, t in e.grads, t) if tensors else (step, t in e.grads) for t, _, step in e.steps]


def generate(graph: IRGraph, plan: Plan, rank: int, header: str = "", probe: bool = False
             ) -> tuple[str, list[StateShard], int]:
    """(source of plan rank ``rank``'s program, the state shards it holds, collectives it issues).

    With ``probe``, ``forward`` takes a keyword ``probe`` told every operator's output, every chain of
    conversion steps and every tensor an operator reads (:mod:`nnscaler.codegen.probe`): the
    instrumented mode that localises a divergence."""
    e = emit_program(graph, plan, rank, probe)
    return render_program(e, header), e.shards, e.collectives


def render_program(e: Emitter, header: str = "") -> str:
    """The Python source of an emitted program."""
    graph, plan, rank, probe, shards = e.graph, e.plan, e.rank, e.probe, e.shards
    params = ", ".join(t.name for t in graph.inputs)
    head = [literal(f'{header}plan rank {rank} of {math.prod(plan.mesh_shape)}, policy {plan.policy or "custom"}, '
                    f'mesh {plan.mesh_shape} {plan.axis_names}. Generated by nnscaler; do not edit.'),  # names escaped
            "import torch", "from nnscaler.runtime import collectives as C", *sorted(e.imports), "",
            f"RANK = {rank}", f"MESH = {plan.mesh_shape}",
            f"# the ranks of this rank's process group on each mesh axis ({', '.join(plan.axis_names)}): g[axis]",
            f"GROUPS = {tuple(next(gr for gr in groups if rank in gr) for groups in axis_groups(plan.mesh_shape))}",
            "DEVICE = torch.device('cuda', torch.cuda.current_device()) if torch.cuda.is_available() else torch.device('cpu')", "# state this rank holds: name -> (full shape, layout per mesh axis, slice per dim,",
            "#                                mesh axis its gradient is summed over after backward)",
            "STATE = {"]
    head += [f"    {s.name!r}: ({s.full_shape}, {s.layout}, {s.slices}, {s.sync_axis})," for s in shards] + ["}"]
    reach = graph.reach_outputs()
    dropped = sorted(t.target or t.name for t in graph.params if t not in reach)
    head += ["# parameters no output is computed from: backward gives them no gradient, so none is synced",
             f"NO_GRAD = frozenset({dropped!r})" if dropped else "NO_GRAD = frozenset()", "", ""]
    body = [f"def forward(p, g, {params}{', probe' if probe else ''}):",
            '    """p: the state this rank holds, by model name; g: its process group on each mesh axis."""']
    lines = e.lines
    hand = any(op.checkpoint is not None for op, _, _ in e.spans)  # the model's own torch.utils.checkpoint calls
    if (e.recompute != "none" or hand) and not probe:  # the instrumented program runs every operator once
        lines, n = wrap(lines, e.spans, e.recompute, [t.name for t in graph.inputs], e.recompute_modules)
        if n:
            head.insert(head.index("import torch") + 1, "from nnscaler.runtime.recompute import checkpoint  # torch.utils.checkpoint, non-reentrant")
    lines = free_dead(lines)  # each intermediate freed after its last use (codegen/frees.py)
    return "\n".join(head + body + lines) + "\n"

