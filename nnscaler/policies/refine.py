"""A reverse pass over a greedy plan: re-plan operators (and chains of their producers) so that
tensors reach their readers in the layouts they want, where that moves less.

The forward greedy (:mod:`nnscaler.policies.greedy`) sees only the producers' layouts. On
multi-query or grouped-query attention with fewer key/value heads than ranks it column-splits the
k/v projection (half the work, its input already whole), which splits the head dim; three
operators later ``repeat_kv`` (unsqueeze, expand, reshape) wants the query heads split and the
program re-lays the expanded k/v out by ``all_to_all``, twice per layer. Walking back, the score
matmul asks for k by heads, the reshape and the expand split the repeats (an identifier no input
has: each rank makes its part), the expand takes its input whole, and that demand travels up
through rotary and the views to the projection's output: one all-gather of the small k (and v)
per layer instead. Replicating the projection instead (Megatron's way) would move nothing, but
costs more by ``COMPUTE_WEIGHT`` than the gather it saves; the cost model decides.

Each operator (in reverse program order) takes the candidate of least cost: elements moved for
its inputs and outputs (a collective costs one element more: of equal bytes, fewer collectives),
plus ``COMPUTE_WEIGHT`` per multiply-add of an operator that contracts a dim (as the forward pass
weighs them). An input it wants in another layout costs the cheaper of converting it and
re-planning its producer, up to ``DEPTH`` producers up a chain (the producer's compute, inputs and
other readers counted against what they cost now); a parameter's first reader may be re-planned
likewise (a dtype assert that fixed its storage). A move never stores a parameter less split than
the forward pass did: tensor parallelism promises that memory.
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
DEPTH = 8  # producers re-planned up a chain to meet one reader (rotary, views and repeat_kv: 6)
STEP = 1.0  # elements a collective costs beyond its bytes: a tie-break towards fewer collectives


def refine(graph: IRGraph, plan: Plan, options: AxisOptions) -> Plan:
    """Improve ``plan`` (a greedy plan of ``graph`` drawn from ``options``) in place; returns it."""
    fused = fused_blocks(graph)
    grads = graph.carries_grad()
    stored = None
    for _ in range(ROUNDS):
        state = _State(graph, plan, grads, options, fused)
        stored = stored or {x: state.split(x) for x in graph.params}  # what the forward pass stored split
        changed = False
        for op in reversed(graph.ops):
            if not op.known:
                continue
            cur = plan.partitions[op.name]
            base, _ = state.total(op, cur, 0)
            if base <= state.compute(op, cur):  # its inputs arrive as it wants them, its readers get theirs
                continue
            best, changes = base, []
            for p in state.candidates(op):
                cost, ch = state.total(op, p, DEPTH)
                if cost < best - 1e-6 and state.keeps_split([(op, p), *ch], stored):
                    best, changes = cost, [(op, p), *ch]
            for o, p in changes:
                plan.partitions[o.name] = p
                state.update(o, p)
            changed |= bool(changes)
        if not changed:
            break
    return plan


class _State:
    """Every tensor's layout under the plan, and what each consumer wants of it."""

    def __init__(self, graph: IRGraph, plan: Plan, grads: set, options: AxisOptions, fused: dict):
        self.graph, self.plan, self.grads, self.fused = graph, plan, grads, fused
        self.opts = self.options(options)
        self.memo: dict = {}  # deliver's answers while no partition changes
        self._cands: dict = {}  # candidates likewise
        self._conv: dict = {}  # conversion costs by layouts (shapes enter only by their element count)
        self._layout: dict = {}
        self.demand: tuple[IRTensor, Layout] | None = None
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

    def candidates(self, op: IROp, demand: tuple[IRTensor, Layout] | None = None) -> list[Partition]:
        """``op``'s partitions the policy offers, also along what its readers want of its outputs
        (and ``demand``: a layout a reader would want of one of them)."""
        key = (op.name, None if demand is None else (id(demand[0]), demand[1]))
        if key not in self._cands:
            self.demand = demand
            try:
                self._cands[key] = candidates(op, self.plan.mesh_shape, self.opts, self.layouts, self.fused.get(op.name))
            finally:
                self.demand = None
        return self._cands[key]

    def update(self, op: IROp, p: Partition) -> None:
        self.memo.clear()
        self._cands.clear()
        lay = self.layout(op, p)
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

    def split(self, x: IRTensor) -> int:
        """Over how many ranks parameter ``x`` is stored split."""
        return math.prod(f for f, q in zip(self.plan.mesh_shape, self.layouts.get(x, self.whole)) if isinstance(q, Shard))

    def keeps_split(self, changes: list, stored: dict) -> bool:
        """Whether ``changes`` store every parameter at least as split as ``stored`` (tensor
        parallelism promises the memory: a parameter the forward pass split stays split, even
        where it is gathered for use)."""
        mesh = self.plan.mesh_shape
        for op, p in changes:
            for x, want in zip(op.inputs, self.layout(op, p).inputs):
                if isinstance(x, IRTensor) and x.kind == PARAM and self.first_use.get(x) is op:
                    have = math.prod(f for f, q in zip(mesh, want or self.whole) if isinstance(q, Shard))
                    if have < stored.get(x, 1):
                        return False
        return True

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
            wants = [w for w, _ in self.wants.get(t, {}).values()] if t is not None and dims else []
            if self.demand is not None and self.demand[0] is t and dims:
                wants.append(self.demand[1])
            for want in wants:
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

    def conv(self, src: Layout, want: Layout, ids: tuple, t: IRTensor) -> float:
        """Elements moved to turn ``src`` into ``want`` for a reader splitting ``ids``, plus ``STEP``
        per collective (of equal bytes, fewer collectives win)."""
        if src == want and all(i is None for i in ids):
            return 0.0
        key = (src, want, ids, len(t.shape), t in self.grads)
        if key not in self._conv:
            steps, frac = conversion(src, want, ids, self.plan.mesh_shape, len(t.shape), t in self.grads)
            self._conv[key] = (frac, len(steps))
        frac, n = self._conv[key]
        return frac * numel(t) + STEP * n

    def layout(self, op: IROp, p: Partition):
        key = (op.name, p)
        if key not in self._layout:
            self._layout[key] = op.layout(p)
        return self._layout[key]

    def _input(self, op: IROp, x: IRTensor, want: Layout, ids: tuple) -> float | None:
        """The cost of ``x`` reaching ``op`` as ``want`` as the plan stands; None where it is free
        (a parameter stored that way, a conversion another reader already makes)."""
        if x.kind in (PARAM, BUFFER, CONSTANT) and self.first_use.get(x) is op:
            return None
        used = tuple(i is not None for i in ids)
        if any(c != op.name and w == want and tuple(i is not None for i in wids) == used
               for c, (w, wids) in self.wants.get(x, {}).items()):
            return None
        return self.conv(self.layouts.get(x, self.whole), want, ids, x)

    def _outputs(self, op: IROp, lay, skip: str | None = None) -> float:
        """What ``op``'s outputs under ``lay`` cost to reach their readers (but ``skip``)."""
        total = 0.0
        for t, out in zip(op.outputs, lay.outputs):
            if t is None or out is None:
                continue
            seen = set()
            for c, (want, ids) in self.wants.get(t, {}).items():
                key = (want, tuple(i is not None for i in ids))
                if c != skip and key not in seen:
                    seen.add(key)
                    total += self.conv(out, want, ids, t)
        return total

    def compute(self, op: IROp, p: Partition) -> float:
        return COMPUTE_WEIGHT * math.prod(op.bound.sizes.values()) / p.degree if _contracts(op) else 0.0

    def total(self, op: IROp, p: Partition, depth: int) -> tuple[float, list]:
        """The cost of ``op`` under ``p``: its compute, its inputs reaching it (each the cheaper of
        converting it or re-planning its producer, ``depth`` producers up), its outputs reaching
        their readers; and the producers' re-plans that cost assumes."""
        lay = self.layout(op, p)
        cost, changes = self.compute(op, p) + self._outputs(op, lay), []
        for x, want in zip(op.inputs, lay.inputs):
            if isinstance(x, IRTensor) and want is not None:
                c, ch = self.deliver(op, x, want, p.axis_ids, depth)
                cost += c
                changes += ch
        return cost, changes

    def deliver(self, reader: IROp, x: IRTensor, want: Layout, ids: tuple, depth: int) -> tuple[float, list]:
        """The cheapest way to have ``x`` reach ``reader`` as ``want``: convert it, or re-plan its
        producer to make ``want`` (its compute, inputs and other readers counted against what they
        cost now)."""
        base = self._input(reader, x, want, ids)
        if not base:  # nothing to move: a producer better re-planned anyway is found on its own turn
            return 0.0, []
        if depth == 0:
            return base, []
        key = (id(x), reader.name, want, ids, depth)
        if key in self.memo:
            return self.memo[key]
        self.memo[key] = best = self._restore(x, want, ids, depth, base) if x.kind in (PARAM, BUFFER, CONSTANT) \
            else self._reproduce(reader, x, want, ids, depth, base)
        return best

    def _restore(self, x: IRTensor, want: Layout, ids: tuple, depth: int, base: float) -> tuple[float, list]:
        """A parameter (buffer, constant) is stored as its first reader wants it: re-plan that
        reader to want ``want`` (a dtype assert or cast read it first, a norm's ``1 + w`` next)."""
        best = (base, [])
        F = self.first_use.get(x)
        if F is None or not F.known:
            return best
        cur = self.plan.partitions[F.name]
        now, _ = self.total(F, cur, 0)
        stored = tuple(Replicate() if isinstance(q, Partial) else q for q in want)
        for c in self.candidates(F):
            lay = self.layout(F, c)
            got = [w for y, w in zip(F.inputs, lay.inputs) if y is x]
            if c == cur or not got or got[0] is None or tuple(
                    Replicate() if isinstance(q, Partial) else q for q in got[0]) != stored:
                continue
            cost, ch = self.total(F, c, depth - 1)
            cost += self.conv(stored, want, ids, x) - now
            if cost < best[0] - 1e-6:
                best = (cost, [(F, c), *ch])
        return best

    def _reproduce(self, reader: IROp, x: IRTensor, want: Layout, ids: tuple, depth: int,
                   base: float) -> tuple[float, list]:
        """Re-plan the producer of ``x`` to make ``want``."""
        best = (base, [])
        P = x.producer
        if P is None or not P.known:
            return best
        cur = self.plan.partitions[P.name]
        cur_lay = self.layout(P, cur)
        now = self.compute(P, cur) + self._outputs(P, cur_lay, skip=reader.name) + sum(
            self._input(P, y, w, cur.axis_ids) or 0.0 for y, w in zip(P.inputs, cur_lay.inputs)
            if isinstance(y, IRTensor) and w is not None)
        k = P.outputs.index(x)
        for c in self.candidates(P, (x, want)):
            lay = self.layout(P, c)
            if c == cur or lay.outputs[k] != want:
                continue
            cost, ch = self.total(P, c, depth - 1)  # its compute, inputs and its outputs' readers
            cost -= self._outputs(P, lay) - self._outputs(P, lay, skip=reader.name)  # this reader: below
            cost += self.conv(want, want, ids, x) - now
            if cost < best[0] - 1e-6:
                best = (cost, [(P, c), *ch])
        return best


def _contracts(op: IROp) -> bool:
    """Whether ``op`` sums over an identifier its outputs lack (a matmul, a norm's statistics): work
    that grows faster than the tensors it touches, the only work worth trading against bytes."""
    out = {i for dims in op.bound.outputs if dims for ids in dims for i in ids}
    return any(not i.isdigit() and i not in out for dims in op.bound.inputs if dims for ids in dims for i in ids)

