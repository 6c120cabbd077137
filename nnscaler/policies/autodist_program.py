"""The integer program behind ``autodist``, for one rank mesh.

One binary ``x[k, c]`` per operator class ``k`` and candidate partition ``c`` (operators from the
same model line with the same shapes, i.e. the same op in every repeated layer, form one class and
share their variables); one continuous ``y[e, cu, cv]`` per producer/consumer class pair ``e``,
tied to the binaries by marginals (``sum_cv y = x[u, cu]``, ``sum_cu y = x[v, cv]``) so that ``y``
is their product without big-M rows. Objective: estimated step time (compute of each choice, the
collectives that convert each tensor from its producer's layout to its consumer's, gradient sync
of parameters held whole). One row: estimated peak memory per rank within the budget.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..comm.conversion import conversion, step_layout
from ..cost.comm import collective_time
from ..cost.compute import op_time, optimizer_time
from ..cost.saved import saved_by_op
from ..cost.steps import OPTIMIZER_STATES, step_collectives
from ..profiles import DeviceProfile
from ..dimops.layout import Layout, Partial, Replicate, Shard
from ..dimops.partition import Partition
from ..runtime.grad_sync import BUCKET_BYTES
from ..ir.graph import BUFFER, CONSTANT, PARAM, IRGraph, IROp, IRTensor
from .greedy import candidates

STATE = (PARAM, BUFFER, CONSTANT)


@dataclass
class OpClass:
    """Operators that take one partition together, and the partitions they may take."""

    ops: list[IROp]
    cands: list[Partition] = field(default_factory=list)
    layouts: list = field(default_factory=list)  # OpLayout per candidate
    blocks: dict[str, int] = field(default_factory=dict)  # identifiers that may be cut in blocks (fused dims)


@dataclass
class Shared:
    """Tensors (one per repeated layer) read by several operators: the program converts each once per
    distinct layout its readers want and reuses it, so a conversion is paid once per layout used."""

    producer: int | None  # the producing class (None: the source layout is fixed)
    consumers: list[tuple[int, list[int]]]  # (class, the wanted-layout index of each of its candidates)
    seconds: np.ndarray  # [producer candidate (one row if fixed), wanted layout] -> seconds, all layers


@dataclass
class Program:
    """Costs of one mesh's program: per class and candidate (unary), per class pair (matrices)."""

    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    classes: list[OpClass]
    seconds: list[np.ndarray]  # per class: step seconds per candidate
    memory: list[np.ndarray]  # per class: bytes per rank per candidate
    pairs: dict[tuple[int, int], np.ndarray]  # (class u, class v) -> seconds[cu, cv]
    shared: list[Shared] = field(default_factory=list)
    fixed_seconds: float = 0.0
    fixed_memory: float = 0.0

    def evaluate(self, choice: list[int]) -> tuple[float, float]:
        """(step seconds, peak bytes per rank) of one candidate index per class."""
        sec = self.fixed_seconds + sum(s[c] for s, c in zip(self.seconds, choice))
        sec += sum(mat[choice[u], choice[v]] for (u, v), mat in self.pairs.items())
        for g in self.shared:
            row = 0 if g.producer is None else choice[g.producer]
            sec += sum(g.seconds[row, k] for k in {keys[choice[v]] for v, keys in g.consumers})
        return sec, self.fixed_memory + sum(m[c] for m, c in zip(self.memory, choice))


def class_key(op: IROp, batch: str | None, blocks: dict[str, int] | None = None) -> tuple:
    """Operators with equal keys sit on the same model line with the same shapes: repeated layers."""
    kinds = tuple(x.kind for x in op.tensor_inputs())
    return (op.overload, op.source or op.name, op.spec.annotation, tuple(sorted(op.bound.sizes.items())), batch, kinds,
            tuple(sorted((blocks or {}).items())))


def op_classes(graph: IRGraph, batch: dict[str, str | None],
               blocks: dict[str, dict[str, int]] | None = None) -> tuple[list[OpClass], dict[IROp, int]]:
    """Known operators grouped by :func:`class_key`, in order of first appearance; ``blocks`` (from
    :func:`.greedy.fused_blocks`): per operator, identifiers its candidates may also cut in blocks."""
    blocks = blocks or {}
    index: dict[tuple, int] = {}
    classes: list[OpClass] = []
    of: dict[IROp, int] = {}
    for op in graph.ops:
        if not op.known:
            continue
        key = class_key(op, batch[op.name], blocks.get(op.name))
        if key not in index:
            index[key] = len(classes)
            classes.append(OpClass([], blocks=dict(blocks.get(op.name, {}))))
        classes[index[key]].ops.append(op)
        of[op] = index[key]
    return classes, of


def _local(t: IRTensor, layout: Layout | None, mesh_shape) -> int:
    n = math.prod(t.shape) * t.dtype.itemsize
    if layout is None:
        return n
    return n // math.prod(f for f, q in zip(mesh_shape, layout) if isinstance(q, Shard))


def _stored(want: Layout) -> Layout:
    return tuple(Replicate() if isinstance(q, Partial) else q for q in want)


class _Costs:
    """Conversion seconds, cached by everything they depend on."""

    def __init__(self, mesh_shape, axis_names, profile: DeviceProfile, grads: set[IRTensor]):
        self.mesh, self.names, self.profile, self.grads = mesh_shape, axis_names, profile, grads
        self.cache: dict[tuple, float] = {}

    def convert(self, t: IRTensor, src: Layout, dst: Layout, ids, bucketed: bool = False,
                synced: bool = False) -> float:
        """Seconds of the collectives converting ``t`` from ``src`` to ``dst`` (and back for its
        gradient); ``synced``: a parameter's later reader, whose gradient the first reader's
        bucketed sync already sums (the runtime syncs a tied parameter once), so no gradient step."""
        grad = t in self.grads and not synced
        key = (t.shape, t.dtype, t.kind, src, dst, tuple(ids), bucketed, grad)
        if key not in self.cache:
            steps, _ = conversion(src, dst, ids, self.mesh, len(t.shape), grad)
            total, cur = 0.0, src
            for st in steps:
                total += sum(c.seconds for c in step_collectives(t, cur, st, self.mesh, self.names, self.profile,
                                                                 bucketed))
                cur = step_layout(cur, st)
            self.cache[key] = total
        return self.cache[key]


def class_candidates(k: OpClass, mesh_shape, options) -> list[Partition]:
    """A class's partitions on the mesh: plain splits, and the same splits cutting a fused dim in
    blocks (Megatron's layout of a fused qkv: this rank's heads of q, of k and of v) where it has one."""
    plain = candidates(k.ops[0], mesh_shape, options, {})
    if not k.blocks:
        return plain
    cut = [p for p in candidates(k.ops[0], mesh_shape, options, {}, k.blocks) if p.blocks]
    return plain + [p for p in cut if p not in plain]


def build_program(graph: IRGraph, classes: list[OpClass], of: dict[IROp, int], mesh_shape, axis_names,
                  options, profile: DeviceProfile, replicas: int = 1) -> Program:
    """Candidates and costs of every class on one mesh (``options`` as for the greedy planner)."""
    for k in classes:
        k.cands = class_candidates(k, mesh_shape, options)
        k.layouts = [k.ops[0].layout(p) for p in k.cands]
    costs = _Costs(mesh_shape, axis_names, profile, graph.carries_grad())
    world = math.prod(mesh_shape)
    ranks_here = min(world * replicas, profile.ranks_per_node)
    whole = tuple(Replicate() for _ in mesh_shape)
    none = tuple(None for _ in mesh_shape)
    seconds = [np.array([len(k.ops) * op_time(k.ops[0], p, profile, ranks_here) for p in k.cands]) for k in classes]
    memory = [np.zeros(len(k.cands)) for k in classes]
    pairs: dict[tuple[int, int], np.ndarray] = {}
    prog = Program(tuple(mesh_shape), tuple(axis_names), classes, seconds, memory, pairs)
    first: dict[IRTensor, tuple[IROp, int]] = {}  # state tensor -> (first consumer, input index)
    uses: dict[IRTensor, list[tuple[IROp, int]]] = {}  # activation -> its (known consumer, input index)
    for op in graph.ops:
        for i, x in enumerate(op.inputs):
            if isinstance(x, IRTensor) and x.kind in STATE and x not in first:
                first[x] = (op, i)
            elif (isinstance(x, IRTensor) and x.kind not in STATE and op.known and i < len(op.bound.inputs)
                  and op.bound.inputs[i] is not None):
                uses.setdefault(x, []).append((op, i))
    rep_across = world * replicas > profile.ranks_per_node
    kept, loose = saved_by_op(graph)
    prog.fixed_memory += loose

    def unary_src(x: IRTensor, src: Layout, k: int, i: int):
        seconds[k] += np.array([costs.convert(x, src, lay.inputs[i], p.axis_ids)
                                for p, lay in zip(classes[k].cands, classes[k].layouts)])

    for op in graph.ops:
        if not op.known:
            for x in op.tensor_inputs():  # wants it whole; no split work, so no gradient sum
                if x.producer is not None and x.producer.known:
                    u, j = of[x.producer], x.producer.outputs.index(x)
                    seconds[u] += np.array([costs.convert(x, lay.outputs[j], whole, none) for lay in classes[u].layouts])
                elif x.kind in STATE and first[x][0].known and first[x][0] is not op:
                    fop, fi = first[x]
                    u = of[fop]
                    seconds[u] += np.array([costs.convert(x, _stored(lay.inputs[fi]), whole, none)
                                            for lay in classes[u].layouts])
            prog.fixed_memory += sum(w for *_, w in kept.get(op.name, ()))
            prog.fixed_seconds += op_time(op, None, profile, ranks_here)
            continue
        v = of[op]
        cls = classes[v]
        for t, where, j, nb in kept.get(op.name, ()):  # what autograd keeps, as the estimate counts it
            memory[v] += np.array([nb * _local(t, (lay.outputs if where == "out" else lay.inputs)[j], mesh_shape)
                                   // max(1, _local(t, None, mesh_shape)) for lay in cls.layouts])
        for i, x in enumerate(op.inputs[:len(op.bound.inputs)]):
            if not isinstance(x, IRTensor) or op.bound.inputs[i] is None:
                continue
            if x.kind in STATE:
                fop, fi = first[x]
                if fop is op and fi == i:  # stored as this op wants it: its memory and gradient sync
                    factor = (2 + OPTIMIZER_STATES) if x.kind == PARAM else 1
                    stored = [_stored(lay.inputs[i]) for lay in cls.layouts]
                    memory[v] += np.array([factor * _local(x, s, mesh_shape) for s in stored])
                    if x.kind == PARAM:
                        seconds[v] += np.array([optimizer_time(_local(x, s, mesh_shape), profile, ranks_here)
                                                for s in stored])
                    seconds[v] += np.array([costs.convert(x, s, lay.inputs[i], p.axis_ids, x.kind == PARAM)
                                            for s, lay, p in zip(stored, cls.layouts, cls.cands)])
                    if x.kind == PARAM and replicas > 1:
                        seconds[v] += np.array([collective_time("all_reduce", _local(x, s, mesh_shape), replicas,
                                                                profile, rep_across,
                                                                min(1.0, _local(x, s, mesh_shape) / BUCKET_BYTES))
                                                for s in stored])
                    continue
                if not fop.known:
                    unary_src(x, whole, v, i)
                    continue
                u, src_of = of[fop], (lambda lay, fi=fi: _stored(lay.inputs[fi]))
                synced = x.kind == PARAM
            elif len(uses[x]) > 1:
                continue  # read by several operators: see _shared
            elif x.producer is None or not x.producer.known:
                unary_src(x, whole, v, i)
                continue
            else:
                u, j = of[x.producer], x.producer.outputs.index(x)
                src_of, synced = (lambda lay, j=j: lay.outputs[j]), False
            mat = np.array([[costs.convert(x, src_of(lu), lv.inputs[i], pv.axis_ids, synced=synced)
                             for lv, pv in zip(cls.layouts, cls.cands)] for lu in classes[u].layouts])
            if u == v:
                seconds[v] += np.diag(mat)
            else:
                pairs[(u, v)] = pairs.get((u, v), 0) + mat
    for o in graph.outputs:
        if isinstance(o, IRTensor) and o.producer is not None and o.producer.known:
            u, j = of[o.producer], o.producer.outputs.index(o)
            seconds[u] += np.array([costs.convert(o, lay.outputs[j], whole, none) for lay in classes[u].layouts])
    prog.shared = _shared(uses, classes, of, costs, whole)
    return prog


def _shared(uses, classes: list[OpClass], of: dict[IROp, int], costs: _Costs, whole: Layout) -> list[Shared]:
    """One :class:`Shared` per kind of tensor read by several operators (its layers' copies add up)."""
    groups: dict[tuple, Shared] = {}
    count: dict[tuple, int] = {}
    for x, readers in uses.items():
        if len(readers) < 2:
            continue
        u = of[x.producer] if x.producer is not None and x.producer.known else None
        j = x.producer.outputs.index(x) if u is not None else None
        key = (u, j, x.shape, x.dtype, tuple((of[op], i) for op, i in readers))
        count[key] = count.get(key, 0) + 1
        if key in groups:
            continue
        wanted: dict[tuple, int] = {}
        consumers = []
        for op, i in readers:
            k = classes[of[op]]
            consumers.append((of[op], [wanted.setdefault((lay.inputs[i], tuple(p.axis_ids)), len(wanted))
                                       for p, lay in zip(k.cands, k.layouts)]))
        srcs = [whole] if u is None else [lay.outputs[j] for lay in classes[u].layouts]
        groups[key] = Shared(u, consumers, np.array([[costs.convert(x, src, dst, ids) for dst, ids in wanted]
                                                     for src in srcs]))
    for key, g in groups.items():
        g.seconds = g.seconds * count[key]
    return list(groups.values())
