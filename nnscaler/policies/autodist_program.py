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
from ..cost.steps import OPTIMIZER_STATES, step_collectives
from ..cost.profiles import DeviceProfile
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


@dataclass
class Program:
    """Costs of one mesh's program: per class and candidate (unary), per class pair (matrices)."""

    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    classes: list[OpClass]
    seconds: list[np.ndarray]  # per class: step seconds per candidate
    memory: list[np.ndarray]  # per class: bytes per rank per candidate
    pairs: dict[tuple[int, int], np.ndarray]  # (class u, class v) -> seconds[cu, cv]
    fixed_seconds: float = 0.0
    fixed_memory: float = 0.0


def class_key(op: IROp, batch: str | None) -> tuple:
    """Operators with equal keys sit on the same model line with the same shapes: repeated layers."""
    kinds = tuple(x.kind for x in op.tensor_inputs())
    return (op.overload, op.source or op.name, op.spec.annotation, tuple(sorted(op.bound.sizes.items())), batch, kinds)


def op_classes(graph: IRGraph, batch: dict[str, str | None]) -> tuple[list[OpClass], dict[IROp, int]]:
    """Known operators grouped by :func:`class_key`, in order of first appearance."""
    index: dict[tuple, int] = {}
    classes: list[OpClass] = []
    of: dict[IROp, int] = {}
    for op in graph.ops:
        if not op.known:
            continue
        key = class_key(op, batch[op.name])
        if key not in index:
            index[key] = len(classes)
            classes.append(OpClass([]))
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

    def __init__(self, mesh_shape, axis_names, profile: DeviceProfile):
        self.mesh, self.names, self.profile = mesh_shape, axis_names, profile
        self.cache: dict[tuple, float] = {}

    def convert(self, t: IRTensor, src: Layout, dst: Layout, ids, bucketed: bool = False) -> float:
        key = (t.shape, t.dtype, t.kind, src, dst, tuple(ids), bucketed)
        if key not in self.cache:
            steps, _ = conversion(src, dst, ids, self.mesh, len(t.shape), t.dtype.is_floating_point)
            total, cur = 0.0, src
            for st in steps:
                total += sum(c.seconds for c in step_collectives(t, cur, st, self.mesh, self.names, self.profile,
                                                                 bucketed))
                cur = step_layout(cur, st)
            self.cache[key] = total
        return self.cache[key]


def build_program(graph: IRGraph, classes: list[OpClass], of: dict[IROp, int], mesh_shape, axis_names,
                  options, profile: DeviceProfile, replicas: int = 1) -> Program:
    """Candidates and costs of every class on one mesh (``options`` as for the greedy planner)."""
    for k in classes:
        k.cands = candidates(k.ops[0], mesh_shape, options, {})
        k.layouts = [k.ops[0].layout(p) for p in k.cands]
    costs = _Costs(mesh_shape, axis_names, profile)
    world = math.prod(mesh_shape)
    ranks_here = min(world * replicas, profile.ranks_per_node)
    whole = tuple(Replicate() for _ in mesh_shape)
    none = tuple(None for _ in mesh_shape)
    seconds = [np.array([len(k.ops) * op_time(k.ops[0], p, profile, ranks_here) for p in k.cands]) for k in classes]
    memory = [np.zeros(len(k.cands)) for k in classes]
    pairs: dict[tuple[int, int], np.ndarray] = {}
    prog = Program(tuple(mesh_shape), tuple(axis_names), classes, seconds, memory, pairs)
    first: dict[IRTensor, tuple[IROp, int]] = {}  # state tensor -> (first consumer, input index)
    for op in graph.ops:
        for i, x in enumerate(op.inputs):
            if isinstance(x, IRTensor) and x.kind in STATE and x not in first:
                first[x] = (op, i)
    rep_across = world * replicas > profile.ranks_per_node

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
            for t in op.outputs:
                if t is not None:
                    prog.fixed_memory += _local(t, None, mesh_shape)
            prog.fixed_seconds += op_time(op, None, profile, ranks_here)
            continue
        v = of[op]
        cls = classes[v]
        for t_idx, t in enumerate(op.outputs):
            if t is not None:
                memory[v] += np.array([_local(t, lay.outputs[t_idx], mesh_shape) for lay in cls.layouts])
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
            elif x.producer is None or not x.producer.known:
                unary_src(x, whole, v, i)
                continue
            else:
                u, j = of[x.producer], x.producer.outputs.index(x)
                src_of = (lambda lay, j=j: lay.outputs[j])
            mat = np.array([[costs.convert(x, src_of(lu), lv.inputs[i], pv.axis_ids)
                             for lv, pv in zip(cls.layouts, cls.cands)] for lu in classes[u].layouts])
            if u == v:
                seconds[v] += np.diag(mat)
            else:
                pairs[(u, v)] = pairs.get((u, v), 0) + mat
    for o in graph.outputs:
        if isinstance(o, IRTensor) and o.producer is not None and o.producer.known:
            u, j = of[o.producer], o.producer.outputs.index(o)
            seconds[u] += np.array([costs.convert(o, lay.outputs[j], whole, none) for lay in classes[u].layouts])
    return prog
