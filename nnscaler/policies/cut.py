"""Cut a traced graph into pipeline stages, and refuse bad pipeline input (too few layers, split points
that are not modules or not in program order, a batch the micro-batches do not divide) with one
clear line before any rank starts work.

A cut falls before an operator that is the first to use one of the model's parameters (the units of
:func:`cut_units`): at the modules the user names (``pp_split``), or where
the estimated compute (forward plus backward, :func:`nnscaler.cost.op_time`) of the heaviest stage
is least, ties broken by the parameter bytes of the heaviest stage (memory). Each stage becomes an
:class:`~nnscaler.ir.graph.IRGraph` of its own: its inputs are the tensors live across the cut before
it (activations, and user inputs a later stage still needs, such as the targets), its outputs those
live across the cut after it (the last stage's are the model's outputs). Parameters used by several
stages (tied embeddings) appear in each; :mod:`nnscaler.runtime.pipeline` sums their gradients.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import replace
from typing import Any, Mapping, Sequence

import torch

from ..config import PlanError, n_stages
from ..cost.compute import op_time
from ..profiles import get_profile
from ..ir.graph import ACTIVATION, INPUT, PARAM, BufferWrite, IRGraph, IROp, IRTensor, remap, tensors_in
from ..runtime.microbatch import MicroBatchError, check_divisible


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
    readers: dict[IRTensor, set[int]] = {}
    for s in range(len(bounds) - 1):
        for op in graph.ops[bounds[s]:bounds[s + 1]]:
            for t in op_reads(op):
                last_use[t] = s
                readers.setdefault(t, set()).add(s)
            for t in op.outputs:
                if t is not None:
                    stage_of[t] = s
    writes_of = stage_writes(graph, stage_of, readers)
    written = {w.buffer for ws in writes_of.values() for w in ws}  # held by the stage writing them
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
        unread = [t for t in graph.params + graph.buffers if t not in last_use and t not in written] if s == 0 else []
        writes = writes_of.get(s, [])
        out.append(_subgraph(graph, ops, live, outputs, unread + [w.buffer for w in writes], writes))
        live = after
    return out


def stage_writes(graph: IRGraph, stage_of: dict[IRTensor, int], readers: dict[IRTensor, set[int]]
                 ) -> dict[int, list[BufferWrite]]:
    """The buffer writes of each stage: a buffer forward writes is written by the stage that
    computes its new value, which must be the only stage reading it (each stage holds its own copy
    of the state it reads); otherwise a :class:`PlanError` names the buffer and the model's line."""
    out: dict[int, list[BufferWrite]] = {}
    for w in graph.writes:
        s = max(stage_of.get(w.value, 0), 0)
        other = sorted(readers.get(w.buffer, set()) - {s})
        if other:
            raise PlanError(f"buffer {w.buffer.target} is written in forward" + (f" ({w.source})" if w.source else "")
                            + f" on pipeline stage {s} but read on stage {other[0]}, which holds its own copy: "
                            f"cut the pipeline elsewhere (pp_split) so one stage reads and writes it")
        out.setdefault(s, []).append(w)
    return out


def _subgraph(graph: IRGraph, ops: list[IROp], inputs: list[IRTensor], outputs: list[Any],
              unread: list[IRTensor] = (), writes: list[BufferWrite] = ()) -> IRGraph:
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
    return IRGraph(new_ops, ins, params, buffers, [remap(o, cp) for o in outputs], constants,
                   writes=[BufferWrite(cp(w.buffer), cp(w.value), w.source) for w in writes])


def cut_units(model: torch.nn.Module) -> list[str]:
    """Modules owning parameters directly (each tied tensor counted once), in definition order: the
    finest units a stage cut may fall between (the "layers" a pipeline can count on)."""
    seen, out = set(), []
    for name, mod in model.named_modules():
        own = [p for p in mod.parameters(recurse=False) if id(p) not in seen]
        if own:
            seen.update(id(p) for p in own)
            out.append(name)
    return out


def run_order(model: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None,
              names: Sequence[str]) -> dict[str, int]:
    """The order in which the named modules first run in one forward of ``model`` on the sample (no
    gradients; the random state and every buffer, a batch norm's running statistics, left as they were).
    A module that never runs is absent."""
    order: dict[str, int] = {}

    def seen(name: str):
        def hook(module, inputs) -> None:  # returns None: the inputs pass unchanged
            order.setdefault(name, len(order))
        return hook
    hooks = [model.get_submodule(n).register_forward_pre_hook(seen(n)) for n in names]
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(*args, **(kwargs or {}))
    except Exception as exc:  # the sample does not fit the model: say so in one line, not a deep traceback
        raise PlanError(f"{type(model).__name__} fails on the sample arguments ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}); pass a batch the model accepts") from None
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(buffers[k])
    return order


def check_split_order(model: torch.nn.Module, split: tuple[str, ...], args: Sequence[Any] = (),
                      kwargs: Mapping[str, Any] | None = None) -> None:
    """Split points name distinct, disjoint modules in the order the model runs them (found by one
    forward on the sample, :func:`run_order`; the traced program confirms it,
    :func:`split_at_modules`). Raises :class:`PlanError`."""
    for a, b in zip(split, split[1:]):
        if a == b or b.startswith(a + ".") or a.startswith(b + "."):
            raise PlanError(f"split points {a!r} and {b!r} {'are the same module' if a == b else 'nest'}; name one "
                            f"module per stage boundary, each after the previous one")
    if len(split) < 2:
        return
    order = run_order(model, args, kwargs, split)
    idle = [n for n in split if n not in order]
    if idle:
        raise PlanError(f"split point {idle[0]!r} never runs in {type(model).__name__}'s forward on the sample; "
                        f"name modules the model runs")
    for a, b in zip(split, split[1:]):
        if order[b] < order[a]:
            raise PlanError(f"split points {list(split)} are not in program order ({b!r} runs before {a!r} in "
                            f"{type(model).__name__}); name them in the order the model runs them")


def check_model(model: torch.nn.Module, args: Sequence[Any], config, kwargs: Mapping[str, Any] | None = None) -> None:
    """The model-dependent pipeline checks: enough layers for the stages, split points that exist
    and hold parameters, a batch divisible into micro-batches. Raises :class:`PlanError`."""
    stages = n_stages(config)
    units = cut_units(model)
    if stages > len(units):
        raise PlanError(f"{stages} pipeline stages but {type(model).__name__} has only {len(units)} layers "
                        f"(modules with parameters) to cut between; use pp_size <= {len(units) // (stages // config.pp_size)}")
    modules = dict(model.named_modules())
    for name in config.pp_split or ():
        if name not in modules:
            close = difflib.get_close_matches(name, list(modules), n=3)
            raise PlanError(f"split point {name!r} is not a module of {type(model).__name__}"
                            + (f"; did you mean {', '.join(close)}?" if close else ""))
        if not any(True for _ in modules[name].parameters()):
            raise PlanError(f"split point {name!r} holds no parameters; name a module with parameters")
    try:
        check_divisible(args, kwargs, config.num_microbatches)
    except MicroBatchError as exc:
        raise PlanError(f"sample_args: {exc}") from None
    check_split_order(model, tuple(config.pp_split or ()), args, kwargs)
