"""One rank's part of a replicas case: a plan for ``plan_ngpus`` ranks run as data-parallel replicas
on ``world_size`` ranks, each replica fed its share of the batch; the loss averaged over replicas,
every gradient (averaged during backward, no call from the training loop) and every parameter after
AdamW steps are judged against single-device training on the whole batch.

The single-device objective is the data-parallel one: the mean over replicas of each share's loss
(what ``DistributedDataParallel`` trains). It is the whole batch's loss whenever every share's loss
averages over as many elements; a loss over targets padded unevenly (``ignore_index``) is not, and
the harness judges the replicas against what they are meant to compute."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from nnscaler.policies import ComputeConfig
from nnscaler.recipe import Recipe
from nnscaler.runtime.mesh import GroupCache

from verify.cases.compiled import compile_case
from verify.config import recipe_tag
from verify.cases.batch import cast, share
from verify.judge.dtypes import to_dtype
from verify.models.loader import file_tag
from verify.judge.verdict import check_deterministic
from verify.judge.finite import require_finite
from verify.judge.lowprec import Precision
from verify.judge.compare import Check, Float64Fallback, check_tensor
from verify.cases.microbatch import loss_fn_of, whole_batch
from verify.cases.fresh import load_like
from verify.models.loader import build_model
from verify.cases.memory import MemoryLog, SavedActivations, measure, storage_bytes
from verify.cases.resume import resume_checks
from verify.cases.model import LR, installed, resolve_policy, step_checks
from verify.cases.reference import SharedReference, reference_grads, reference_models
from verify.cases.pipeline import is_pipeline_policy
from verify.cases.pipeline_replicas import LOSS, run_pipeline_replicas_case
from verify.cases.precision_record import PrecisionRecord
from verify.cases.samples import DTYPES
from verify.cases.traces import TraceCache, tracer_of


def replica_label(policy: str, replicas: int) -> str:
    """The partition column of a replicas row: ``tp x2 replicas``."""
    return f"{policy} x{replicas} replicas"


MEAN = "loss step {} (mean over replicas)"


def _loss_check(policy: str, microbatches: int) -> str:
    """The loss check's name: the mean of the replicas' losses (one batch per replica), or, with
    micro-batches or a pipeline (``train_step``), the exact loss of the whole batch over replicas."""
    return LOSS if is_pipeline_policy(policy) or microbatches > 1 else MEAN


def expected_replica_checks(name: str, steps: int, seed: int, policy: str = "", microbatches: int = 1) -> list[str]:
    """The names of every check a rank must return for a replicas case (a short list is a failure)."""
    params = [n for n, _ in build_model(name, seed).model.named_parameters()]
    loss = _loss_check(policy, microbatches)
    names = []
    for s in range(steps):
        names += [loss.format(s), *(f"grad {n} step {s}" for n in params),
                  *(f"param {n} after step {s}" for n in params)]
    return names


def run_replicas_job(job: dict, groups: GroupCache, traces: TraceCache | None = None,
                     memory: MemoryLog | None = None) -> list[Check]:
    """The checks of a ``model`` job planned on fewer ranks than it runs on (keys: model, policy,
    world_size, plan_ngpus, steps, seed, gen_dir, and optionally dtype and the recipe); ``traces``: the rank's trace cache."""
    return run_replicas_case(job["model"], job["policy"], job["world_size"], job["plan_ngpus"],
                             job["steps"], job["seed"], groups, job["gen_dir"],
                             dtype=job.get("dtype", "float32"), recipe=Recipe.from_dict(job.get("recipe")),
                             traces=traces, memory=memory)


def run_replicas_case(name: str, policy: str, world_size: int, plan_ngpus: int, steps: int, seed: int,
                      groups: GroupCache, gen_dir: str, dtype: str = "float32", recipe: Recipe = Recipe(),
                      traces: TraceCache | None = None, memory: MemoryLog | None = None) -> list[Check]:
    """Checks for ``steps`` AdamW steps of ``name`` planned on ``plan_ngpus`` ranks, replicated to
    ``world_size``, under the training ``recipe`` (gradient-sync buckets default the model's). With
    ``recipe.num_microbatches`` M above 1 each step's batch is M of the model's batches stacked, each
    replica trains its share by ``train_step`` in M micro-batches (the loss exact over all replicas),
    and the reference is one device on the whole batch. A pipeline policy:
    :mod:`verify.cases.pipeline_replicas`. The references mimic the recipe (they clip with torch and
    run its precision, :class:`~verify.judge.lowprec.Precision`), judged by the low-precision rule
    under bf16. ``memory``: where the last step's measured memory on this rank is left."""
    if is_pipeline_policy(policy):
        return run_pipeline_replicas_case(name, policy, world_size, plan_ngpus, steps, seed, groups, gen_dir, dtype,
                                          recipe, traces)
    clip, microbatches, precision = recipe.clip_grad_norm, recipe.num_microbatches, Precision.of(recipe)
    dt = DTYPES["bfloat16" if precision.precision == "bf16-true" else dtype]
    case = build_model(name, seed)
    to_dtype(case.model, dt)
    reference = SharedReference.of(groups, world_size)  # computed on rank 0 alone (verify/cases/reference.py)
    if reference.computes:
        ref, ref64, params, ref_opt = reference_models(name, seed, case.model, dt, precision, LR)
    replicas, rank = world_size // plan_ngpus, dist.get_rank()
    replica = rank // plan_ngpus
    recipe = replace(recipe, bucket_bytes=case.bucket_bytes if recipe.bucket_bytes is None else recipe.bucket_bytes)
    config = ComputeConfig(plan_ngpus, runtime_ngpus=world_size, seed=seed, recipe=recipe)
    batch = (lambda step: whole_batch(case.batch, step, microbatches)) if microbatches > 1 else case.batch
    loss_fn = loss_fn_of(case)
    pm = compile_case(case.model, share(cast(batch(0), dt), replica, replicas), resolve_policy(policy), config, groups,
                      Path(gen_dir) / f"{file_tag(name)}-{file_tag(policy)}{recipe_tag(recipe)}-p{plan_ngpus}"
                                      f"-w{world_size}-{dtype}-s{seed}",
                      tracer_of(traces, name))
    check_deterministic(pm.graph, f"{replicas} data-parallel replicas")
    replica_ranks = [rank % plan_ngpus + r * plan_ngpus for r in range(replicas)]
    start = reference.share(lambda: {n: p.detach().clone() for n, p in params.items()})
    shadow = {n: t.clone() for n, t in start.items()}  # AdamW on one device, fed the replicas' grads
    record = PrecisionRecord.of(recipe)  # the recipe's precision, checked structurally
    opts = [record.watch(pm.build_optimizer(torch.optim.AdamW, lr=LR))]  # sharded over the replicas under zero
    opts += [torch.optim.AdamW(shadow.values(), lr=LR)]
    checks: list[Check] = []
    fallback = Float64Fallback(dt, lowprec=precision.active)

    def one_device_step(refs: list) -> dict:
        """The step on one device (the computing rank): the mean of ``refs``' losses, its gradients."""
        load_like(ref64, ref)
        loss_ref = sum(ref(*a) for a in refs) / len(refs)
        loss_ref.backward()
        with fallback:  # an operator without a float64 kernel runs in the test dtype (the bound widens)
            loss64 = sum(ref64(*cast(a, torch.float64)) for a in refs) / len(refs)
            loss64.backward()
        if clip is not None:  # the single-device recipe: torch's own clipping
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            torch.nn.utils.clip_grad_norm_(ref64.parameters(), clip)
        grads, grads64 = reference_grads(params, ref64)
        return require_finite({"loss": loss_ref.detach(), "loss64": loss64.detach(), "grads": grads,
                               "grads64": grads64}, step)

    for step in range(steps):  # judged as every whole-model case is (verify/judge/compare.py)
        args = cast(batch(step), dt)
        shares = [share(args, r, replicas) for r in range(replicas)]
        point = {n: t.clone() for n, t in start.items()} if step == 0 else \
            reference.share(lambda: {n: p.detach().clone() for n, p in params.items()})
        pm.load_state_dict({k: point.get(k, v) for k, v in pm.state_dict().items()})
        checks.append(installed(pm, point, step))
        with record:  # the dtypes the program's step reduces, sends and computes in (bf16-mixed only)
            if microbatches > 1:  # the whole batch's loss over every replica, exactly (train_step's weighting)
                mean = pm.train_step(*shares[replica], loss_fn=loss_fn)
                refs = [args]
            else:
                saved = SavedActivations(pm.parameters())  # measured memory per rank (verify/cases/memory.py)
                with saved:
                    loss = pm(*shares[replica])
                loss.backward()
                if clip is not None:  # what train_step does with ComputeConfig(clip_grad_norm=...)
                    pm.clip_grad_norm_(clip)
                grad_bytes = storage_bytes(pm.grad_tensors())
                mean = loss.detach().clone()
                dist.all_reduce(mean, group=groups.get(replica_ranks))
                mean = mean / replicas
                refs = shares  # the data-parallel objective (see above)
        one = reference.share(lambda: one_device_step(refs), fallback)
        widen, kw = fallback.widen, fallback.bounds()
        checks.append(check_tensor(_loss_check(policy, microbatches).format(step), mean, one["loss"],
                                   one["loss64"], **kw))
        checks += step_checks(pm, one["grads"], one["grads64"], shadow, point, opts, step, widen, kw)
        if reference.computes:  # AdamW on one device: the next step's point
            ref_opt.step()
            ref_opt.zero_grad()
        if microbatches == 1 and memory is not None:
            memory.last = measure(pm, opts[0], saved.bytes, grad_bytes)
    checks = record.checks(pm, opts[0], mean, one["loss"]) + checks  # a narrower dtype named first
    # the checkpoint of the replicas (optimizer state sharded over them under zero) resumes on one device
    # and under another plan at W=2, as every whole-model case's does
    checks += resume_checks(name, policy, world_size, seed, steps, pm, opts[0], groups, gen_dir, dt, traces, precision,
                            fallback.spreads, zero=recipe.zero)
    checks += fallback.notes(dtype, checks)
    return checks
