"""A reverse pass over a greedy plan: pull each operator's output towards the layout its consumers
want, moving a conversion up to the operator's inputs, and dropping it where those inputs already
have what the new partition wants.

The forward greedy (:mod:`nnscaler.policies.greedy`) sees only the producers' layouts. On
multi-query or grouped-query attention with fewer key/value heads than ranks it column-splits the
k/v projection (the cheapest choice it sees: half the work, its input already whole), which splits
the head dim; three operators later ``repeat_kv`` (unsqueeze, expand, reshape) wants the query
heads split and the program re-lays the expanded k/v out by ``all_to_all``. Walking the operators
in reverse, each picks the candidate with the least communication counted on both sides (what its
inputs need from their producers, what its outputs need to reach their consumers): the expand
splits its repeat dim and takes its input whole, the demand for a whole tensor travels up through
rotary and the views, and the k/v projection runs whole on every rank with no collective at all,
which is Megatron's way (replicate the kv heads, split the query heads).

Communication decides, ties go to the candidate whose outputs need less (so a conversion moves up
towards a producer that may absorb it), then to less compute; an operator changes only when that
strictly improves it. Compute is not traded against bytes here: the forward pass already did that,
and this pass only accepts moves that do not add communication.
"""
from __future__ import annotations

import math

from ..comm.conversion import conversion
from ..dimops.layout import Layout, Partial, Replicate, Shard
from ..dimops.partition import Partition
from ..ir.graph import BUFFER, CONSTANT, PARAM, IRGraph, IROp, IRTensor, tensors_in
from ..ir.plan import Plan
from .greedy import COMPUTE_WEIGHT, AxisOptions, candidates, fused_blocks, numel

ROUNDS = 3  # a demand travels the whole program in one round; a second and third settle what it changed


def refine(graph: IRGraph, plan: Plan, options: AxisOptions) -> Plan:
    """Improve ``plan`` (a greedy plan of ``graph`` drawn from ``options``) in place; returns it."""
    fused = fused_blocks(graph)
    grads = graph.carries_grad()
    for _ in range(ROUNDS):
        state = _State(graph, plan, grads)
        changed = False
        for op in reversed(graph.ops):
            if not op.known:
                continue
            cur = plan.partitions[op.name]
            cands = candidates(op, plan.mesh_shape, state.options(options), state.layouts, fused.get(op.name))
            best = min(cands, key=lambda p: state.cost(op, p))
            if state.cost(op, best) < state.cost(op, cur):
                plan.partitions[op.name] = best
                state.update(op, best)
                changed = True
        if not changed:
            break
    return plan


class _State:
    """Every tensor's layout under the plan, and what each consumer wants of it."""

    def __init__(self, graph: IRGraph, plan: Plan, grads: set):
        self.graph, self.plan, self.grads = graph, plan, grads
        self.whole: Layout = tuple(Replicate() for _ in plan.mesh_shape)
        self.layouts: dict[IRTensor, Layout] = {t: self.whole for t in graph.inputs}
        self.first_use: dict[IRTensor, IROp] = {}  # a parameter is stored as its first consumer wants it
        self.wants: dict[IRTensor, dict[str, tuple[Layout, tuple]]] = {}  # tensor -> consumer -> (layout, axis ids)
        for op in graph.ops:
            for x in op.tensor_inputs():
                if x.kind in (PARAM, BUFFER, CONSTANT):
                    self.first_use.setdefault(x, op)
            if op.known:
                self.update(op, plan.partitions[op.name])
            else:
                for x in op.tensor_inputs():
                    self.layouts.setdefault(x, self.whole)
                    self.wants.setdefault(x, {})[op.name] = (self.whole, (None,) * len(self.whole))
                for t in op.outputs:
                    if t is not None:
                        self.layouts[t] = self.whole
        for t in tensors_in(graph.outputs):  # the program returns whole tensors
            self.wants.setdefault(t, {})["<output>"] = (self.whole, (None,) * len(self.whole))

    def update(self, op: IROp, p: Partition) -> None:
        lay = op.layout(p)
        for x, want in zip(op.inputs, lay.inputs):
            if isinstance(x, IRTensor):
                w = self.wants.setdefault(x, {})
                w.pop(op.name, None)
                if want is not None:
                    w[op.name] = (want, p.axis_ids)
                if x.kind in (PARAM, BUFFER, CONSTANT) and self.first_use.get(x) is op:
                    self.layouts[x] = tuple(Replicate() if isinstance(q, Partial) else q for q in (want or self.whole))
        for t, out in zip(op.outputs, lay.outputs):
            if t is not None and out is not None:
                self.layouts[t] = out

    def options(self, options: AxisOptions) -> AxisOptions:
        """``options``, plus each identifier of an output dim a consumer wants split along the axis
        that the policy would offer had the inputs arrived split along it, or that no input has (the
        new dim of an ``expand``: each rank makes its own part, its inputs stay as they are). The
        forward pass offered only what the inputs already had split; an operator the policy pins,
        such as a vocabulary-parallel embedding, gains nothing."""
        def more(op: IROp, axis: int, layouts: dict):
            base = list(options(op, axis, layouts))
            read = {i for dims in op.bound.inputs if dims for ids in dims for i in ids}
            for i in self._demanded(op, axis):
                if i not in base and (i not in read or i in options(op, axis, self._as_if_split(op, axis, i, layouts))):
                    base.append(i)
            return base
        return more

    def _demanded(self, op: IROp, axis: int) -> list[str]:
        out = []
        for t, dims in zip(op.outputs, op.bound.outputs):
            for want, _ in self.wants.get(t, {}).values() if t is not None and dims else ():
                q = want[axis]
                if isinstance(q, Shard) and q.dim < len(dims):
                    i = next((i for i in dims[q.dim] if not i.isdigit()), None)
                    if i is not None and i not in out:
                        out.append(i)
        return out

    def _as_if_split(self, op: IROp, axis: int, ident: str, layouts: dict) -> dict:
        """``layouts`` with ``op``'s inputs split along ``axis`` on their dims that ``ident`` leads."""
        hyp = dict(layouts)
        for x, dims in zip(op.inputs, op.bound.inputs):
            if not isinstance(x, IRTensor) or dims is None:
                continue
            d = next((d for d, ids in enumerate(dims) if next((i for i in ids if not i.isdigit()), None) == ident), None)
            if d is not None:
                lay = list(layouts.get(x, self.whole))
                lay[axis] = Shard(d)
                hyp[x] = tuple(lay)
        return hyp

    def cost(self, op: IROp, p: Partition) -> tuple[float, float, float]:
        """(bytes moved for ``op``'s inputs and outputs, of them for its outputs, its compute) under
        ``p``, the other operators' partitions as they stand."""
        lay = op.layout(p)
        mesh = self.plan.mesh_shape
        used = tuple(i is not None for i in p.axis_ids)
        inputs = 0.0
        for x, want in zip(op.inputs, lay.inputs):
            if not isinstance(x, IRTensor) or want is None:
                continue
            if x.kind in (PARAM, BUFFER, CONSTANT) and self.first_use.get(x) is op:
                continue  # stored the way this operator wants it
            others = self.wants.get(x, {})
            if any(c != op.name and w == want and tuple(i is not None for i in ids) == used
                   for c, (w, ids) in others.items()):
                continue  # another consumer already has it converted so: the program reuses it
            src = self.layouts.get(x, self.whole)
            inputs += conversion(src, want, p.axis_ids, mesh, len(x.shape), x in self.grads)[1] * numel(x)
        outputs = 0.0
        for t, out in zip(op.outputs, lay.outputs):
            if t is None or out is None:
                continue
            seen = set()
            for c, (want, ids) in self.wants.get(t, {}).items():
                key = (want, tuple(i is not None for i in ids))
                if key not in seen:
                    seen.add(key)
                    outputs += conversion(out, want, ids, mesh, len(t.shape), t in self.grads)[1] * numel(t)
        work = math.prod(op.bound.sizes.values()) / p.degree
        contracts = COMPUTE_WEIGHT * work if _contracts(op) else 0.0
        return round(inputs + outputs + contracts, 6), round(outputs, 6), work


def _contracts(op: IROp) -> bool:
    """Whether ``op`` sums over an identifier its outputs lack (a matmul, a norm's statistics): work
    that grows faster than the tensors it touches, the only work worth trading against bytes."""
    out = {i for dims in op.bound.outputs if dims for ids in dims for i in ids}
    return any(not i.isdigit() and i not in out for dims in op.bound.inputs if dims for ids in dims for i in ids)

