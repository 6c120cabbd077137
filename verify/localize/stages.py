"""The first divergent operator of a pipeline case or a replicas case that mismatches.

A pipeline is localised stage by stage: the pipelined module is compiled as the case compiled it,
and each stage's graph and plan run instrumented on that stage's ranks, fed at the stage's inputs
(the cut activations, and the user inputs it reads) with the single-device run's values on the first
micro-batch, and, at its outputs, with the single-device run's gradients; every operator is then
compared as :func:`verify.localize.model.localize_program` compares a whole program. The earliest stage holding a
divergence names it; when every stage matches alone, the fault lies between stages. A replicas case
is localised as a plain case of its plan on its ``W / R`` plan ranks (on the whole step-0 batch);
when that plan matches, the fault lies in the sync between replicas.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from nnscaler.policies import ComputeConfig

from verify.cases.compiled import compile_case
from verify.cases.batch import cast
from verify.judge.dtypes import to_dtype
from verify.localize.eager import NOT_THE_MODEL
from verify.localize.model import Localized, divergence, localize_model_case, probed_program, references, single_program
from verify.localize.tensor_trace import Recorder, compare
from verify.cases.microbatch import whole_batch
from verify.cases.fresh import built_like
from verify.models.loader import build_model
from verify.models.loader import file_tag
from verify.cases.pipeline import is_pipeline_policy, pipeline_microbatches
from verify.cases.samples import DTYPES

BETWEEN_STAGES = ("every stage matches alone: the divergence lies between stages (transfers, schedule, loss "
                  "scaling, gradients of parameters shared by stages)")


def _inputs(g, dev: Recorder, graph_inputs: dict) -> list[torch.Tensor]:
    """A stage's inputs: the single-device values, floating ones that carry a gradient as leaves."""
    out = []
    for t in g.inputs:
        v = (dev.output(t.name) if dev.has_output(t.name) else graph_inputs[t.name]).clone()
        out.append(v.requires_grad_(v.is_floating_point() and dev.output(t.name, grad=True) is not None))
    return out


def _backward(g, outs, cotangents: dict, last: bool) -> None:
    """Backward from a stage's outputs: each output's cotangent, or, in the ``last`` stage, 1 for the
    loss (its 0-dim output)."""
    outs = outs if isinstance(outs, tuple) else (outs,)
    pairs = []
    for t, y in zip(g.outputs, outs):
        grad = cotangents.get(getattr(t, "name", None))
        if grad is None and last and isinstance(y, torch.Tensor) and y.dim() == 0:
            grad = torch.ones_like(y)  # the last stage's loss
        if grad is not None and isinstance(y, torch.Tensor) and y.requires_grad:
            pairs.append((y, grad.to(y.dtype)))
    if pairs:
        torch.autograd.backward([y for y, _ in pairs], [gr for _, gr in pairs])


def stage_cotangents(graphs, model, dev: Recorder, graph_inputs: dict) -> list[dict]:
    """Per stage, the single-device gradient of the loss at each of its outputs through the later
    stages only (the whole run's gradient of a cut tensor also counts its uses inside the stage):
    the stages run on one device from the last back, each fed the gradients of the next one's inputs."""
    out: list[dict] = [{} for _ in graphs]
    for s in range(len(graphs) - 1, -1, -1):
        program, state = single_program(graphs[s], model)
        inputs = _inputs(graphs[s], dev, graph_inputs)
        _backward(graphs[s], program.forward(state, (None,), *inputs, probe=Recorder()), out[s], s == len(graphs) - 1)
        if s:
            out[s - 1] = {t.name: x.grad for t, x in zip(graphs[s].inputs, inputs) if x.grad is not None}
    return out


def _run_stage(module, model: torch.nn.Module, graph_inputs: dict, dev: Recorder, cotangents: dict,
               last: bool) -> Recorder:
    """One stage's program, instrumented, on the single-device values at its inputs, back-propagated
    from the single-device ``cotangents`` at its outputs (this rank's part; its stage ranks all call it)."""
    g, mesh = module.graph, module.mesh
    program, local = probed_program(g, module.plan, mesh, model)
    rec = Recorder()
    _backward(g, program.forward(local, mesh.groups, *_inputs(g, dev, graph_inputs), probe=rec), cotangents, last)
    return rec


def localize_pipeline_case(name: str, policy: str, world_size: int, seed: int, groups, gen_dir: str,
                           dtype: str = "float32", microbatches: int = 1) -> Localized:
    """Where pipeline case ``name`` under ``policy`` first diverges, stage by stage, or
    :data:`BETWEEN_STAGES` (every rank of the case calls this; all get the same answer). The profile
    is every stage's, in stage order, each label prefixed ``sS:``."""
    from verify.cases.model import resolve_policy
    dt = DTYPES[dtype]
    m = pipeline_microbatches(policy, microbatches)
    case = build_model(name, seed)
    model = to_dtype(case.model, dt)
    micro = cast(case.batch(0), dt)  # the first micro-batch of step 0, the shapes the stages are made for
    config = ComputeConfig(world_size, tp_size=2 if world_size % 2 == 0 else 1, seed=seed, num_microbatches=m)
    pm = compile_case(built_like(name, seed, model, dt), cast(whole_batch(case.batch, 0, m), dt), resolve_policy(policy),
                      config, groups, Path(gen_dir) / f"localize-{file_tag(name)}-{file_tag(policy)}-w{world_size}-s{seed}",
                      announce=False)
    graph = pm.graph
    dev, ref, bounds = references(graph, model, micro, dt)
    graph_inputs = {t.name: a for t, a in zip(graph.inputs, micro)}
    n = len(pm.plans)
    cotangents = stage_cotangents(pm.graphs, model, dev, graph_inputs)
    mine, profiles = {}, {}
    for s in sorted(int(k) for k in pm.stages):  # a rank's stages in order: their ranks meet in the same order
        module = pm.stages[str(s)]
        par = _run_stage(module, model, graph_inputs, dev, cotangents[s], s == n - 1)
        trace = compare(par, dev, ref, module.mesh.groups, bounds)
        profiles[s] = [[f"s{s}:{row[0]}", *row[1:]] for row in trace.profile()]
        if trace.first is not None:
            k, first = module.plan.world_size, module.mesh.offset
            where = f"stage {s} of {n} (ranks {first}-{first + k - 1})" if k > 1 else f"stage {s} of {n} (rank {first})"
            mine[s] = divergence(module.graph, module.plan, trace, par, k, name, seed, dtype, where)
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, (mine, profiles), group=groups.get(list(range(world_size))))
    stages = {s: d for part, _ in everyone for s, d in part.items()}
    profile = {s: p for _, part in everyone for s, p in part.items()}
    rows = [row for s in sorted(profile) for row in profile[s]]
    return Localized(stages[min(stages)], "", rows) if stages else Localized(None, BETWEEN_STAGES, rows)


def localize_replicas_case(name: str, policy: str, world_size: int, plan_ngpus: int, seed: int, groups,
                           gen_dir: str, dtype: str = "float32", microbatches: int = 1,
                           failing: str = "") -> Localized | None:
    """Where ``policy``'s plan alone on ranks ``0 .. plan_ngpus - 1`` first diverges (the others
    return ``None`` at once; a pipeline is localised stage by stage there), or where the plan
    matches, that the fault is in replica sync, unless the model itself is not its traced graph
    (``failing``: the row's first failing check, :mod:`verify.localize.eager`)."""
    if dist.get_rank() >= plan_ngpus:
        return None
    if is_pipeline_policy(policy):
        found = localize_pipeline_case(name, policy, plan_ngpus, seed, groups, gen_dir, dtype, microbatches)
        if found.found is None:
            found.note = f"one pipeline alone on {plan_ngpus} ranks: {found.note}; or in replica sync"
            return found
    else:
        found = localize_model_case(name, policy, plan_ngpus, seed, groups, gen_dir, dtype, failing=failing)
        if found.found is None and NOT_THE_MODEL in found.note:  # the trace, not the replicas
            return found
    if found.found is None:
        found.note = (f"the plan matches alone on {plan_ngpus} ranks: the divergence lies in replica sync "
                      f"(gradients averaged across the {world_size // plan_ngpus} replicas, or a buffer's batch "
                      f"statistic gathered over their rows: nnscaler/runtime/replica_rows.py)")
        return found
    alone = f"the plan alone on {plan_ngpus} of {world_size} ranks"
    found.found.where = f"{found.found.where} of {alone}" if found.found.where else alone
    return found
