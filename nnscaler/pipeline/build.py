"""``parallelize`` for ``pp_size > 1``: trace one micro-batch, cut the graph into stages, plan and
generate every stage over its own ranks, and wrap this rank's stages for the schedule."""
from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from ..codegen.emit import generate
from ..plan_api import canonical_params, plan_graph
from ..policies.plan import ComputeConfig, PlanError
from ..runtime.mesh import GroupCache, RankMesh
from ..runtime.microbatch import split_batch
from ..runtime.module import ParallelModule
from ..trace.build import trace
from .checks import check_model, n_stages
from .cut import balanced_cuts, split_at_modules, stage_graphs
from .policies import PIPELINE_POLICIES
from .runtime import PipelineModule
from .schedules import canonical_schedule, stages_per_rank

def pipeline_config(policy, config: ComputeConfig) -> tuple[Any, ComputeConfig]:
    """``(stage policy, config)``: a pipeline policy's name sets ``pp_size`` and the schedule."""
    if isinstance(policy, str) and policy in PIPELINE_POLICIES:
        p = PIPELINE_POLICIES[policy]
        return p.stage_policy, dataclasses.replace(config, pp_size=p.pp(config.plan_ngpus), schedule=p.schedule)
    return policy, config


def stage_config(config: ComputeConfig) -> ComputeConfig:
    """The config each stage is planned under: its own ``plan_ngpus // pp_size`` ranks, no replicas
    (those are the whole pipeline's), ``tp_size`` capped at them (``hybrid`` stages: dp x tp)."""
    k = config.plan_ngpus // config.pp_size
    return dataclasses.replace(config, plan_ngpus=k, runtime_ngpus=None, pp_size=1, schedule="1F1B",
                               pp_split=None, tp_size=min(config.tp_size or k, k))


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
                         groups: GroupCache | None = None, verify: str | bool = False,
                         verify_cache: str | os.PathLike | None = None, tracer=None) -> PipelineModule:
    """This rank's :class:`PipelineModule` (see :func:`nnscaler.parallelize`). ``verify``: every stage
    plan's (operator, partition) pairs verified as ``parallelize`` verifies a plan (on the first
    stage's ranks, the rest take their verdicts; same cache), refused or warned before any code.
    ``tracer`` traces one micro-batch, as in ``parallelize``."""
    from ..parallel import _ensure_process_group, _import, _save, _verify_plan  # as parallelize does
    stage_policy, config = pipeline_config(policy, config)
    if sample_kwargs:
        raise PlanError("a pipelined model takes positional arguments only (sample_kwargs is not supported)")
    m = config.num_microbatches
    check_model(model, sample_args, config)  # bad input, before any process group
    _ensure_process_group()
    world, rank = dist.get_world_size(), dist.get_rank()
    runtime, replicas, plan_ngpus = config.runtime_ngpus or config.plan_ngpus, config.replicas, config.plan_ngpus
    if world != runtime and not (groups is not None and runtime <= world):
        raise PlanError(f"the process group has {world} ranks but the config asks for {runtime} "
                        f"(runtime_ngpus, or plan_ngpus when runtime_ngpus is unset)")
    pp, v = config.pp_size, stages_per_rank(config.schedule)
    k = plan_ngpus // pp
    graph = (tracer or trace)(model, split_batch(sample_args, None, m)[0][0], None, registry=registry, strict=strict)
    canonical_params(model, graph)
    total = n_stages(config)
    cuts = (split_at_modules(graph, model, tuple(config.pp_split)) if config.pp_split
            else balanced_cuts(graph, total, config.profile))
    graphs = stage_graphs(graph, cuts)
    plans = [plan_graph(g, stage_policy, stage_config(config)) for g in graphs]
    cache = groups if groups is not None else GroupCache()
    pipeline_groups(pp, k, [p.mesh_shape for p in plans], cache, groups is None, replicas)
    if verify:  # ranks 0 .. k-1 verify each stage plan; every rank of the pipeline takes the verdicts
        checked = dataclasses.replace(stage_config(config), runtime_ngpus=runtime)
        for g, plan in zip(graphs, plans):
            _verify_plan(g, plan, checked, verify, cache, groups is not None, verify_cache)
    replica, plan_rank = rank // plan_ngpus, rank % plan_ngpus
    base = replica * plan_ngpus  # this replica's first rank
    prank, local = plan_rank // k, plan_rank % k
    pp_group = cache.get([base + local + s * k for s in range(pp)])
    replica_group = cache.get([plan_rank + r * plan_ngpus for r in range(replicas)]) if replicas > 1 else None
    state = {**graph.constants, **dict(model.named_buffers()), **dict(model.named_parameters())}
    trainable = {n for n, _ in model.named_parameters()}
    mine = [s for s in range(total) if s % pp == prank]
    modules = {}
    for s in mine:
        g, plan = graphs[s], plans[s]
        digest = hashlib.sha256("\n".join([str(g), plan.describe(), repr(config), str(s)]).encode()).hexdigest()
        source, _, _ = generate(g, plan, local, header=f"[{digest}] {type(model).__name__} stage {s} of {total}: ")
        path = _save(Path(gen_savedir) / f"stage_{s}", local, source, reuse)
        program = _import(source, path, local)
        mesh = RankMesh.build(plan.mesh_shape, rank, cache, offset=base + prank * k)
        module = ParallelModule(program, state, mesh, trainable, replica_group, replicas,
                                bucket_bytes=config.bucket_bytes)
        module.plan, module.graph = plan, g
        modules[s] = module
    if rank == 0:
        print(f"pipeline: {total} stages ({pp} ranks x {v}), {k} rank(s) each, schedule "
              f"{canonical_schedule(config.schedule)}, {m} micro-batches"
              + (f", {replicas} replicas" if replicas > 1 else "")
              + f"; stages begin at operators {[0] + cuts} of {len(graph.ops)}", flush=True)
    pm = PipelineModule(modules, graphs, config, m, pp_group, prank, local, k, replica_group, replicas)
    pm.process_group = None if runtime == world else cache.get(list(range(runtime)))
    pm.plans, pm.graph = plans, graph
    return pm
