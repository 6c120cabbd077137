"""``nnscaler.parallelize``: trace, plan, verify, generate one program per plan rank, and run this rank's.

The one compile driver: :func:`parallelize` and the pipeline's :func:`~.pipeline.parallelize_pipeline`
take the same steps, from the same modules: :mod:`.plan` (trace and a checked plan), :mod:`.gate`
(verification), :mod:`.artifacts` (the program written, saved, imported and wrapped) and
:mod:`.groups` (process groups)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..config import ComputeConfig, PlanError
from ..ir.plan import Policy
from ..ops.registry import OpRegistry
from ..policies.pipeline import is_pipeline_policy
from ..runtime.mesh import GroupCache, RankMesh
from ..runtime.microbatch import MicroBatchError, split_batch
from ..runtime.module import ParallelModule
from ..trace.build import Tracer
from .artifacts import build_rank_module
from .gate import Verifier, check_mode, verify_on_ranks
from .groups import ensure_process_group, module_group, replica_group
from .pipeline import parallelize_pipeline
from .precision import prepare_model
from .respecialise import Respecialiser, emitted, planned, state_guards
from .zero import zero_spec
from .plan import resolve_policy, write_report


def parallelize(model: torch.nn.Module, sample_args: Sequence[Any], policy: str | Policy, config: ComputeConfig,
                *, gen_savedir: str | os.PathLike = ".nnscaler", reuse: bool = True, strict: bool = False,
                sample_kwargs: Mapping[str, Any] | None = None, registry: OpRegistry | None = None,
                groups: GroupCache | None = None, verify: str | bool = "strict",
                verify_cache: str | os.PathLike | None = None, tracer: Tracer | None = None,
                verifier: Verifier | None = None) -> ParallelModule:
    """Compile ``model`` for ``config.plan_ngpus`` ranks under ``policy`` and return this rank's module.

    Every rank of the default process group (created from the ``torchrun`` environment if none
    exists) calls this with the same model and sample arguments. The generated program of each
    plan rank is written to ``gen_savedir`` and reused while a hash of the traced graph, the plan and
    the config matches. Ranks beyond ``plan_ngpus`` are data-parallel replicas, each fed its own
    share of the batch; gradients are averaged over them during backward. With ``config.num_microbatches``
    above 1, ``sample_args`` is a whole batch (each tensor's dim 0 a multiple of it) and the program is
    compiled for one micro-batch of it; train with ``module.train_step(*batch)``. ``groups`` reuses process groups made
    beforehand (then only ranks ``0 .. runtime_ngpus-1`` take part; others need not call).

    A cached program is run only if its text is exactly what the compiler writes now (anything else
    is rewritten); writes go under a lock on ``gen_savedir/.lock``, so jobs may share the directory.
    Raises :class:`PlanError` (a policy gives no valid plan), :class:`GenSaveDirError` (``gen_savedir``
    is unusable) or ``nnscaler.codegen.render.CodegenError`` (a value the program cannot write down).

    ``verify``: before generating code, every (operator, partition) pair the plan uses is verified on
    these ranks by ``verifier`` (default: the one installed under the ``nnscaler.verifiers`` entry
    point, the harness; cached on disk in ``verify_cache``, default ``~/.cache/nnscaler-verify``):
    ``"strict"`` (the default: compile only what passed) raises :class:`PlanError` naming a failing
    operator and partition (or when no verifier is installed), ``"warn"`` warns and compiles anyway,
    ``False`` skips it.

    ``config.pp_size > 1`` (or a pipeline policy's name, :data:`nnscaler.policies.pipeline.PIPELINE_POLICIES`)
    cuts the model into pipeline stages, each partitioned by ``policy`` over its own ranks, and returns a
    :class:`nnscaler.runtime.pipeline.PipelineModule` (train with its ``train_step``); ``verify`` then
    checks every stage's plan.

    A model that branches on its own state (a buffer's value: I-BERT's ``QuantAct``) gets a program per
    branch: when the branch the trace took stops holding, the module traces ``model`` again on its current
    state, plans it alike and runs that program on the same parameters (:mod:`.respecialise`); such a
    module keeps a reference to ``model`` for it (no other does).

    ``tracer``: what traces the model, called as :func:`nnscaler.trace.build.trace` is (default: that);
    a caller compiling one model under several plans may hand back a graph it traced before, on a
    copy (:meth:`~nnscaler.ir.graph.IRGraph.copy`), as ``verify``'s per-rank trace cache does.
    """
    check_mode(verify)
    sample_args, sample_kwargs = prepare_model(model, sample_args, sample_kwargs, config.precision)  # bf16-true: bf16 model
    if config.pp_size > 1 or is_pipeline_policy(policy):  # pipeline stages: .pipeline
        return parallelize_pipeline(model, sample_args, policy, config, gen_savedir=gen_savedir, reuse=reuse,
                                    strict=strict, sample_kwargs=sample_kwargs, registry=registry, groups=groups,
                                    verify=verify, verify_cache=verify_cache, tracer=tracer, verifier=verifier)
    if config.num_microbatches > 1:  # the sample is a whole batch; the program runs one micro-batch
        try:
            sample_args, sample_kwargs = split_batch(sample_args, sample_kwargs, config.num_microbatches)[0]
        except MicroBatchError as exc:
            raise PlanError(f"sample_args: {exc}") from None
    name, _ = resolve_policy(policy)
    graph, plan = planned(model, sample_args, sample_kwargs, policy, config, name, registry=registry, strict=strict,
                          tracer=tracer)
    world, rank, runtime = ensure_process_group(config, groups)
    cache = groups if groups is not None else GroupCache()
    verify_on_ranks(graph, plan, config, verify, verifier, cache, groups is not None, verify_cache)
    plan_rank, replica = rank % config.plan_ngpus, rank // config.plan_ngpus
    program = emitted(graph, plan, config, plan_rank)
    for r in range(config.replicas if groups is None else 0):  # every rank creates every group, in order
        cache.create_for_shapes([plan.mesh_shape], offset=r * config.plan_ngpus)
    mine = None
    if config.replicas > 1:
        for p in range(config.plan_ngpus):
            g = replica_group(cache, [p + r * config.plan_ngpus for r in range(config.replicas)], groups is None)
            mine = g if p == plan_rank else mine
    mesh = RankMesh.build(plan.mesh_shape, rank, cache, offset=replica * config.plan_ngpus)
    zero = zero_spec(plan, config, rank, cache, groups is None)
    key, label = [repr(config), name], type(model).__name__
    module = build_rank_module(model, graph, plan, program, plan_rank=plan_rank, key=key, label=label,
                               directory=Path(gen_savedir), reuse=reuse, mesh=mesh, replica_group=mine,
                               replicas=config.replicas, recipe=config.recipe, zero=zero)
    if state_guards(graph):  # a branch on the model's state: a program per branch (holds the model: only then)
        module.respecialise = Respecialiser(model, policy, config, name, plan_rank=plan_rank, key=key, label=label,
                                            directory=Path(gen_savedir), reuse=reuse, registry=registry,
                                            strict=strict, verify=verify, verifier=verifier, groups=cache,
                                            user_groups=groups is not None, verify_cache=verify_cache,
                                            report=rank == 0)
    if rank == 0:  # the one-line summary, and the report next to the generated code
        print(plan.one_line(), flush=True)
        write_report(plan, gen_savedir)
    module.process_group = module_group(cache, runtime, world)
    return module
