"""Cut a traced graph into pipeline stages.

A cut falls before an operator that is the first to use one of the model's parameters (the units of
:func:`nnscaler.pipeline.checks.cut_units`): at the modules the user names (``pp_split``), or where
the estimated compute (forward plus backward, :func:`nnscaler.cost.op_time`) of the heaviest stage
is least, ties broken by the parameter bytes of the heaviest stage (memory). Each stage becomes an
:class:`~nnscaler.ir.graph.IRGraph` of its own: its inputs are the tensors live across the cut before
it (activations, and user inputs a later stage still needs, such as the targets), its outputs those
live across the cut after it (the last stage's are the model's outputs). Parameters used by several
stages (tied embeddings) appear in each; :mod:`nnscaler.pipeline.runtime` sums their gradients.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from ..cost.compute import op_time
from ..cost.profiles import get_profile
from ..ir.graph import ACTIVATION, INPUT, PARAM, IRGraph, IROp, IRTensor, remap, tensors_in
from ..policies.plan import PlanError


def op_reads(op: IROp) -> list[IRTensor]:
    """Every tensor ``op`` reads (nested lists and keyword arguments included)."""
    return op.tensor_inputs()


def first_uses(graph: IRGraph) -> dict[str, int]:
    """Parameter name -> index of the first operator reading it."""
    out: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        for t in op_reads(op):
            if t.kind == PARAM:
                out.setdefault(t.target, i)
    return out


def candidates(graph: IRGraph) -> list[int]:
    """Operator indices a stage may begin at (after the first): the first use of some parameter."""
    uses = sorted(set(first_uses(graph).values()))
    return uses[1:]


def split_at_modules(graph: IRGraph, model: torch.nn.Module, names: tuple[str, ...]) -> list[int]:
    """The operator index where each named module's stage begins (the first use of its parameters)."""
    canonical = {}
    for n, p in model.named_parameters():
        canonical.setdefault(id(p), n)
    uses = first_uses(graph)
    cuts = []
    for name in names:
        mod = model.get_submodule(name)
        idx = [uses[canonical[id(p)]] for p in mod.parameters() if canonical.get(id(p)) in uses]
        if not idx:
            raise PlanError(f"split point {name!r}: the traced model never uses its parameters")
        cuts.append(min(idx))
    if any(b <= a for a, b in zip([0] + cuts, cuts)):
        raise PlanError(f"split points {list(names)} do not begin stages in program order with something in each "
                        f"(their first operators are {cuts}); name them in the order the model runs them")
    return cuts


def stage_costs(graph: IRGraph, profile: str | None = None) -> tuple[list[float], list[float]]:
    """Per operator: estimated seconds of forward plus backward on one rank, and the bytes of the
    parameters it is the first to use."""
    prof = get_profile(profile)
    time = [op_time(op, None, prof, 1) for op in graph.ops]
    first = first_uses(graph)
    pbytes = [0.0] * len(graph.ops)
    for t in graph.params:
        if t.target in first:
            pbytes[first[t.target]] += math.prod(t.shape) * t.dtype.itemsize
    return time, pbytes


def best_cuts(time: list[float], pbytes: list[float], cands: list[int], n_stages: int) -> list[int]:
    """The ``n_stages - 1`` cuts among ``cands`` (sorted operator indices) that minimise the heaviest
    stage's ``(time, bytes)`` (lexicographically): a dynamic program over the candidate boundaries."""
    if n_stages - 1 > len(cands):
        raise PlanError(f"{n_stages} pipeline stages but the model has only {len(cands) + 1} layers (first uses of "
                        f"parameters) to cut between; use fewer stages")
    ct, cb = [0.0], [0.0]
    for a, b in zip(time, pbytes):
        ct.append(ct[-1] + a)
        cb.append(cb[-1] + b)
    bounds = [0] + list(cands) + [len(time)]
    n = len(bounds) - 1
    best = {(0, 0): ((0.0, 0.0), [])}  # (stages so far, boundary index) -> (heaviest stage, cuts)
    for k in range(1, n_stages + 1):
        for j in range(k, n + 1) if k < n_stages else (n,):
            opts = [(max(best[(k - 1, i)][0], (ct[bounds[j]] - ct[bounds[i]], cb[bounds[j]] - cb[bounds[i]])),
                     best[(k - 1, i)][1] + ([bounds[i]] if i else []))
                    for i in range(k - 1, j) if (k - 1, i) in best]
            if opts:
                best[(k, j)] = min(opts, key=lambda o: o[0])
    return best[(n_stages, n)][1]


def balanced_cuts(graph: IRGraph, n_stages: int, profile: str | None = None) -> list[int]:
    """``n_stages - 1`` cut indices that minimise the heaviest stage's estimated compute, then its
    parameter bytes (memory)."""
    time, pbytes = stage_costs(graph, profile)
    return best_cuts(time, pbytes, candidates(graph), n_stages)


def stage_graphs(graph: IRGraph, cuts: list[int]) -> list[IRGraph]:
    """One graph per stage, cut before the operators at ``cuts``; every stage's tensors are copies
    (their producers and consumers lie in that stage)."""
    bounds = [0] + list(cuts) + [len(graph.ops)]
    stage_of: dict[IRTensor, int] = {t: -1 for t in graph.inputs}
    last_use: dict[IRTensor, int] = {}
    for s in range(len(bounds) - 1):
        for op in graph.ops[bounds[s]:bounds[s + 1]]:
            for t in op_reads(op):
                last_use[t] = s
            for t in op.outputs:
                if t is not None:
                    stage_of[t] = s
    final = tensors_in(graph.outputs)
    for t in final:
        last_use[t] = len(bounds) - 1  # read after the last stage
    live = list(graph.inputs)  # stage 0 takes every user input, as the schedule gives them
    out = []
    for s in range(len(bounds) - 1):
        ops = graph.ops[bounds[s]:bounds[s + 1]]
        made = [t for op in ops for t in op.outputs if t is not None]
        after = [t for t in live + made if last_use.get(t, -2) > s]
        outputs = final if s == len(bounds) - 2 else after
        # parameters and buffers no operator reads still belong to the model's state: stage 0 keeps them
        unread = [t for t in graph.params + graph.buffers if t not in last_use] if s == 0 else []
        out.append(_subgraph(graph, ops, live, outputs, unread))
        live = after
    return out


def _subgraph(graph: IRGraph, ops: list[IROp], inputs: list[IRTensor], outputs: list[Any],
              unread: list[IRTensor] = ()) -> IRGraph:
    copies: dict[IRTensor, IRTensor] = {}

    def cp(t: IRTensor, kind: str | None = None) -> IRTensor:
        if t not in copies:
            copies[t] = replace(t, kind=kind or t.kind, producer=None, consumers=[])
        return copies[t]

    ins = [cp(t, INPUT) for t in inputs]
    new_ops = []
    for op in ops:
        new = replace(op, inputs=remap(op.inputs, cp), outputs=[None if t is None else cp(t, ACTIVATION) for t in op.outputs],
                      kwargs=remap(op.kwargs, cp))
        for t in new.tensor_inputs():
            t.consumers.append(new)
        for t in new.outputs:
            if t is not None:
                t.producer = new
        new_ops.append(new)
    for t in unread:
        cp(t)
    used = set(copies)
    params = [copies[t] for t in graph.params if t in used]
    buffers = [copies[t] for t in graph.buffers if t in used]
    constants = {k: v for k, v in graph.constants.items() if any(t.target == k for t in graph.buffers if t in used)}
    return IRGraph(new_ops, ins, params, buffers, [remap(o, cp) for o in outputs], constants)
