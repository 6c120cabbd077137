"""``parallelize`` for ``pp_size > 1``: trace one micro-batch, cut the graph into stages, plan and
generate every stage over its own ranks (the same steps as :func:`~.parallelize.parallelize`, stage
by stage), and wrap this rank's stages for the schedule."""
from __future__ import annotations

import dataclasses
import os
from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from .precision import apply_precision
from ..codegen.emit import emit_program
from ..config import ComputeConfig, PlanError, n_stages, per_rank
from ..ir.graph import IRGraph, IRTensor
from ..ops.rules import TensorMeta
from ..policies.cut import balanced_cuts, check_model, split_at_modules, stage_graphs
from ..policies.pipeline import pipeline_config, stage_config
from ..runtime.mesh import GroupCache, RankMesh
from ..runtime.microbatch import split_batch
from ..runtime.pipeline import PipelineModule, StageMeta
from ..runtime.schedules import canonical_schedule
from ..trace.build import Tracer
from .artifacts import build_rank_module
from .gate import Verifier, check_mode, verify_on_ranks
from .groups import ensure_process_group, module_group
from .plan import attach_stats, choose_plan, trace_model
from .writes import check_writes
from .zero import check_pipeline_zero, stage_zero_specs


def stage_meta(graph: IRGraph) -> StageMeta:
    """What the runtime needs of stage ``graph``: its inputs' and outputs' shapes and dtypes, and the
    shapes of the parameters and buffers it holds."""
    def meta(t):
        return TensorMeta(tuple(t.shape), t.dtype) if isinstance(t, IRTensor) else None
    return StageMeta(tuple(meta(t) for t in graph.inputs), tuple(meta(t) for t in graph.outputs),
                     {t.target: tuple(t.shape) for t in graph.params}, {t.target: tuple(t.shape) for t in graph.buffers})


def pipeline_groups(pp: int, k: int, mesh_shapes, cache: GroupCache, create: bool, replicas: int = 1) -> None:
    """Create (collectively, same order everywhere) each stage's mesh groups (``mesh_shapes[s]``: stage
    ``s``'s plan mesh, on pipeline rank ``s % pp``), each pipeline group and, with ``replicas``, each
    replica group. Runtime rank ``replica * P + (stage % pp) * k + local`` (``P = pp * k``), as
    ``parallelize`` lays replicas out."""
    if not create:
        return
    plan = pp * k
    for r in range(replicas):
        for s, shape in enumerate(mesh_shapes):
            cache.create_for_shapes([shape], offset=r * plan + (s % pp) * k)
        cache.create_for_shapes([(pp, k)], offset=r * plan)  # axis 0: the pipeline groups {local + s*k}
    if replicas > 1:
        cache.create_for_shapes([(replicas, plan)])  # axis 0: the replica groups {p + r*P}


def parallelize_pipeline(model: torch.nn.Module, sample_args: Sequence[Any], policy, config: ComputeConfig, *,
                         gen_savedir: str | os.PathLike, reuse: bool = True, strict: bool = False,
                         sample_kwargs: Mapping[str, Any] | None = None, registry=None,
                         groups: GroupCache | None = None, verify: str | bool = "strict",
                         verify_cache: str | os.PathLike | None = None, tracer: Tracer | None = None,
                         verifier: Verifier | None = None) -> PipelineModule:
    """This rank's :class:`PipelineModule` (see :func:`nnscaler.parallelize`). ``verify``: every stage
    plan's (operator, partition) pairs verified as ``parallelize`` verifies a plan (on the first
    stage's ranks, the rest take their verdicts; same cache), refused or warned before any code.
    ``tracer`` traces one micro-batch, as in ``parallelize``."""
    check_mode(verify)
    stage_policy, config = pipeline_config(policy, config)
    if sample_kwargs:
        raise PlanError("a pipelined model takes positional arguments only (sample_kwargs is not supported)")
    m = config.num_microbatches
    check_model(model, sample_args, config)  # bad input, before any process group
    replicas, plan_ngpus = config.replicas, config.plan_ngpus
    pp, v = config.pp_size, per_rank(config)
    k = plan_ngpus // pp
    graph = trace_model(model, split_batch(sample_args, None, m)[0][0], None, registry=registry, strict=strict,
                        tracer=tracer)
    check_writes(graph, config)  # a buffer written from the batch under replicas: refused by name
    total = n_stages(config)
    cuts = (split_at_modules(graph, model, tuple(config.pp_split)) if config.pp_split
            else balanced_cuts(graph, total, config.profile))
    apply_precision(graph, config.precision)  # before the cut: the stages share its operators
    graphs = stage_graphs(graph, cuts)
    each = stage_config(config)
    plans = [choose_plan(g, stage_policy, each) for g in graphs]  # refused before any process group
    check_pipeline_zero(plans, config, stage_policy if isinstance(stage_policy, str) else type(stage_policy).__name__)
    world, rank, runtime = ensure_process_group(config, groups)
    cache = groups if groups is not None else GroupCache()
    pipeline_groups(pp, k, [p.mesh_shape for p in plans], cache, groups is None, replicas)
    checked = dataclasses.replace(each, runtime_ngpus=runtime)  # ranks 0 .. k-1 verify, every rank takes verdicts
    for g, plan in zip(graphs, plans):
        verify_on_ranks(g, plan, checked, verify, verifier, cache, groups is not None, verify_cache)
    replica, plan_rank = rank // plan_ngpus, rank % plan_ngpus
    base = replica * plan_ngpus  # this replica's first rank
    prank, local = plan_rank // k, plan_rank % k
    pp_group = cache.get([base + local + s * k for s in range(pp)])
    replica_group = cache.get([plan_rank + r * plan_ngpus for r in range(replicas)]) if replicas > 1 else None
    tied = frozenset(n for n, c in Counter(t for g in graphs for t in {p.target for p in g.params}).items() if c > 1)
    zeros = stage_zero_specs(plans, config, rank, pp, k, cache, groups is None, tied) if config.zero else {}
    modules = {}
    # the pipeline (PipelineModule) runs the micro-batches and clips; each stage runs one micro-batch at a time
    stage_recipe = dataclasses.replace(config.recipe, num_microbatches=1, clip_grad_norm=None)
    for s in range(total):
        g, plan = graphs[s], plans[s]
        emitted = emit_program(g, plan, local, recompute=config.recompute, recompute_modules=config.recompute_modules
                               ) if s % pp == prank else None  # once per stage this rank runs
        attach_stats(plan, g, each, emitted.steps if emitted is not None else None)
        if emitted is None:
            continue
        mesh = RankMesh.build(plan.mesh_shape, rank, cache, offset=base + prank * k)
        modules[s] = build_rank_module(model, g, plan, emitted, plan_rank=local, key=[repr(config), str(s)],
                                       label=f"{type(model).__name__} stage {s} of {total}",
                                       directory=Path(gen_savedir) / f"stage_{s}", reuse=reuse, mesh=mesh,
                                       replica_group=replica_group, replicas=replicas,
                                       recipe=stage_recipe, zero=zeros.get(s))
    if rank == 0:
        print(f"pipeline: {total} stages ({pp} ranks x {v}), {k} rank(s) each, schedule "
              f"{canonical_schedule(config.schedule)}, {m} micro-batches"
              + (f", {replicas} replicas" if replicas > 1 else "")
              + f"; stages begin at operators {[0] + cuts} of {len(graph.ops)}", flush=True)
    pm = PipelineModule(modules, [stage_meta(g) for g in graphs], config, pp_group, prank, local, k, replica_group,
                        replicas)
    pm.process_group = module_group(cache, runtime, world)
    pm.plans, pm.graph = plans, graph
    pm.graphs = graphs  # every stage's graph, in stage order (this rank runs pm.stages)
    return pm
