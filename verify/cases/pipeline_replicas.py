"""One rank's part of a replicas case under a pipeline policy: the pipeline planned on ``plan_ngpus``
ranks, run as data-parallel replicas on ``world_size`` ranks (``ComputeConfig(runtime_ngpus=...)``).
Each replica trains its share of the batch (``microbatches``, at least ``PIPELINE_MICROBATCHES``, of
the model's batches per replica) by ``train_step``; the replicas' gradients are averaged once, after
the last micro-batch, with the exact whole-batch weighting ``(loss_sum, count)`` over replicas. So the
reference is one device on the WHOLE batch (every replica's share), as for micro-batches
(``verify/cases/microbatch.py``), not the mean of the shares' losses. Judged as every whole-model case:
loss, every gradient and every parameter after AdamW steps; then the sharded checkpoint (replicas
write their pieces once) resumed on one device, under another pipeline and under another plan
(``verify/cases/resume.py``)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from nnscaler.policies import ComputeConfig
from nnscaler.recipe import Recipe
from nnscaler.runtime.mesh import GroupCache

from verify.cases.compiled import compile_case
from verify.cases.precision_record import PrecisionRecord
from verify.config import recipe_tag
from verify.cases.batch import cast, share
from verify.judge.dtypes import to_dtype
from verify.cases.resume import resume_checks
from verify.judge.verdict import check_deterministic
from verify.judge.finite import require_finite
from verify.judge.compare import Check, Float64Fallback, check_tensor
from verify.cases.microbatch import loss_fn_of, whole_batch
from verify.cases.fresh import load_like
from verify.models.loader import build_model
from verify.cases.model import LR, installed, step_checks
from verify.cases.reference import SharedReference, reference_grads, reference_models
from verify.models.loader import file_tag
from verify.cases.pipeline import PIPELINE_MICROBATCHES
from verify.cases.samples import DTYPES
from verify.cases.traces import TraceCache, tracer_of
from verify.judge.lowprec import Precision

LOSS = "loss step {} (whole batch over replicas)"


def run_pipeline_replicas_case(name: str, policy: str, world_size: int, plan_ngpus: int, steps: int, seed: int,
                               groups: GroupCache, gen_dir: str, dtype: str = "float32", recipe: Recipe = Recipe(),
                               traces: TraceCache | None = None) -> list[Check]:
    """Checks for ``steps`` AdamW steps of pipeline ``policy`` planned on ``plan_ngpus`` ranks and run as
    replicas on ``world_size`` under the training ``recipe`` (at least :data:`PIPELINE_MICROBATCHES`
    micro-batches; each stage's gradient-sync buckets default the model's; ZeRO over the replicas and
    each stage's dp axis; ``train_step`` clipping as ``ComputeConfig(clip_grad_norm=...)`` asks, the
    reference with ``torch.nn.utils.clip_grad_norm_``; the precision run alike by the reference and
    judged by the low-precision rule, as in :mod:`verify.cases.replicas`)."""
    clip, precision = recipe.clip_grad_norm, Precision.of(recipe)
    dt = DTYPES["bfloat16" if precision.precision == "bf16-true" else dtype]
    case = build_model(name, seed)
    to_dtype(case.model, dt)
    reference = SharedReference.of(groups, world_size)  # computed on rank 0 alone (verify/cases/reference.py)
    if reference.computes:
        ref, ref64, params, ref_opt = reference_models(name, seed, case.model, dt, precision, LR)
    replicas, replica = world_size // plan_ngpus, dist.get_rank() // plan_ngpus
    m = max(recipe.num_microbatches, PIPELINE_MICROBATCHES)
    batch = lambda step: cast(whole_batch(case.batch, step, m * replicas), dt)  # noqa: E731 (every replica's share)
    recipe = replace(recipe, num_microbatches=m,
                     bucket_bytes=case.bucket_bytes if recipe.bucket_bytes is None else recipe.bucket_bytes)
    config = ComputeConfig(plan_ngpus, runtime_ngpus=world_size, seed=seed, tp_size=2 if plan_ngpus % 2 == 0 else 1,
                           recipe=recipe)
    tag = f"{file_tag(name)}-{file_tag(policy)}{recipe_tag(recipe)}-p{plan_ngpus}-w{world_size}-{dtype}-s{seed}"
    pm = compile_case(case.model, share(batch(0), replica, replicas), policy, config, groups, Path(gen_dir) / tag,
                      tracer_of(traces, name))
    check_deterministic(pm.graph, f"{replicas} replicas of a pipeline")
    loss_fn = loss_fn_of(case)
    start = reference.share(lambda: {n: p.detach().clone() for n, p in params.items()})
    shadow = {n: t.clone() for n, t in start.items()}  # AdamW on one device, fed the replicas' grads
    record = PrecisionRecord.of(recipe)  # the recipe's precision, checked structurally
    opts = [record.watch(pm.build_optimizer(torch.optim.AdamW, lr=LR))]  # sharded over the replicas under zero
    opts += [torch.optim.AdamW(shadow.values(), lr=LR)]
    checks: list[Check] = []
    fallback = Float64Fallback(dt, lowprec=precision.active)

    def one_device_step(args: tuple) -> dict:
        """The step on one device (the computing rank) on the whole batch ``args``."""
        load_like(ref64, ref)
        loss_ref = ref(*args)
        loss_ref.backward()
        with fallback:  # an operator without a float64 kernel runs in the test dtype (the bound widens)
            loss64 = ref64(*cast(args, torch.float64))
            loss64.backward()
        if clip is not None:  # the single-device recipe: torch's own clipping (train_step clipped the replicas)
            for model in (ref, ref64):
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        grads, grads64 = reference_grads(params, ref64)
        return require_finite({"loss": loss_ref.detach(), "loss64": loss64.detach(), "grads": grads,
                               "grads64": grads64}, step)

    for step in range(steps):
        args = batch(step)
        point = {n: t.clone() for n, t in start.items()} if step == 0 else \
            reference.share(lambda: {n: p.detach().clone() for n, p in params.items()})
        pm.load_state_dict({k: point.get(k, v) for k, v in pm.state_dict().items()})
        checks.append(installed(pm, point, step))
        with record:  # the dtypes the program's step reduces, sends and computes in (bf16-mixed only)
            loss = pm.train_step(*share(args, replica, replicas), loss_fn=loss_fn)
        one = reference.share(lambda: one_device_step(args), fallback)
        widen, kw = fallback.widen, fallback.bounds()
        checks.append(check_tensor(LOSS.format(step), loss.detach(), one["loss"], one["loss64"], **kw))
        checks += step_checks(pm, one["grads"], one["grads64"], shadow, point, opts, step, widen, kw)
        if reference.computes:  # AdamW on one device: the next step's point
            ref_opt.step()
            ref_opt.zero_grad()
    checks = record.checks(pm, opts[0], loss, one["loss"]) + checks  # a narrower dtype named first
    checks += resume_checks(name, f"{policy}-x{replicas}", world_size, seed, steps, pm, opts[0], groups, gen_dir, dt,
                            traces, precision, fallback.spreads, zero=recipe.zero)
    checks += fallback.notes(dtype, checks)
    return checks
