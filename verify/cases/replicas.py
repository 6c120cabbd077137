"""One rank's part of a replicas case: a plan for ``plan_ngpus`` ranks run as data-parallel replicas
on ``world_size`` ranks, each replica fed its share of the batch; the loss averaged over replicas,
every gradient (averaged during backward, no call from the training loop) and every parameter after
AdamW steps are judged against single-device training on the whole batch.

The single-device objective is the data-parallel one: the mean over replicas of each share's loss
(what ``DistributedDataParallel`` trains). It is the whole batch's loss whenever every share's loss
averages over as many elements; a loss over targets padded unevenly (``ignore_index``) is not, and
the harness judges the replicas against what they are meant to compute. Under micro-batches or a
pipeline (``train_step``) the replicas' loss is exact over the whole batch, and so is the reference.
A model whose forward writes a buffer runs the whole batch in one forward on one device, as each
replica runs one forward per step (a statistic of the batch written from every replica's rows,
:mod:`nnscaler.compile.writes`); every buffer is compared after every step.

The loop is :mod:`verify.cases.training`'s; this module holds its replicas' strategies."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nnscaler.recipe import Recipe
from nnscaler.runtime.mesh import GroupCache

from verify.cases.batch import cast
from verify.cases.buffers import buffer_names, held, reference_buffers
from verify.cases.fresh import load_like
from verify.cases.kinks import KinkSides, explainer
from verify.cases.memory import MemoryLog
from verify.cases.microbatch import loss_fn_of
from verify.cases.model import resolve_policy
from verify.cases.pipeline import PIPELINE_MICROBATCHES, is_pipeline_policy
from verify.cases.recipe_steps import apply_steps
from verify.cases.reference import reference_grads
from verify.cases.samples import DTYPES
from verify.cases.traces import TraceCache
from verify.cases.training import (ForwardBackward, PipelineReplicated, ReplicaShare, Replicated, Training, TrainStep,
                                   built, train, with_buckets)
from verify.judge.compare import Check, Float64Fallback
from verify.judge.finite import require_finite
from verify.judge.lowprec import Precision
from verify.models.loader import build_model


def replica_label(policy: str, replicas: int) -> str:
    """The partition column of a replicas row: ``tp x2 replicas``."""
    return f"{policy} x{replicas} replicas"


MEAN = "loss step {} (mean over replicas)"
LOSS = "loss step {} (whole batch over replicas)"


def _loss_check(policy: str, microbatches: int) -> str:
    """The loss check's name: the mean of the replicas' losses (one batch per replica), or, with
    micro-batches or a pipeline (``train_step``), the exact loss of the whole batch over replicas."""
    return LOSS if is_pipeline_policy(policy) or microbatches > 1 else MEAN


def expected_replica_checks(name: str, steps: int, seed: int, policy: str = "", microbatches: int = 1) -> list[str]:
    """The names of every check a rank must return for a replicas case (a short list is a failure)."""
    model = build_model(name, seed).model
    params, buffers = [n for n, _ in model.named_parameters()], buffer_names(model)
    loss = _loss_check(policy, microbatches)
    names = []
    for s in range(steps):
        names += [loss.format(s), *(f"grad {n} step {s}" for n in params),
                  *(f"param {n} after step {s}" for n in params), *(f"buffer {n} after step {s}" for n in buffers)]
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
    and the reference is one device on the whole batch. The references mimic the recipe (they clip with
    torch and run its precision, :class:`~verify.judge.lowprec.Precision`), judged by the low-precision
    rule under bf16. ``memory``: where the last step's measured memory on this rank is left (not under
    micro-batches or a pipeline). Then the checkpoint of the replicas (optimizer state sharded over
    them under zero) resumes on one device and under another plan at W=2, as every whole-model case's
    does. A pipeline policy: :func:`_pipeline_replicas`. The loop: :func:`verify.cases.training.train`."""
    dt = DTYPES["bfloat16" if Precision.of(recipe).precision == "bf16-true" else dtype]
    case = built(name, seed, dt)
    replicas, rank = world_size // plan_ngpus, dist.get_rank()
    replica = rank // plan_ngpus
    if is_pipeline_policy(policy):
        return _pipeline_replicas(name, policy, world_size, plan_ngpus, steps, seed, groups, gen_dir, dtype, dt,
                                  recipe, case, traces)
    microbatches = recipe.num_microbatches
    t = Training(name, seed, world_size, steps, groups, gen_dir, dtype, dt, with_buckets(recipe, case), case, traces,
                 memory)
    if microbatches > 1:  # the whole batch's loss over every replica, exactly (train_step's weighting)
        stepper = TrainStep(loss_fn_of(case))
    else:  # the mean of the replicas' losses: the data-parallel objective (see above)
        stepper = ForwardBackward(mean_over=(groups, [rank % plan_ngpus + r * plan_ngpus for r in range(replicas)]))
    return train(t, Replicated(policy, resolve_policy, plan_ngpus, replicas),
                 ReplicaShare(microbatches, replicas, replica, per_share=microbatches == 1), stepper,
                 MeanOfShares(recipe, _loss_check(policy, microbatches), Precision.of(recipe).active))


def _pipeline_replicas(name: str, policy: str, world_size: int, plan_ngpus: int, steps: int, seed: int,
                       groups: GroupCache, gen_dir: str, dtype: str, dt: torch.dtype, recipe: Recipe, case,
                       traces: TraceCache | None) -> list[Check]:
    """A pipeline ``policy`` planned on ``plan_ngpus`` ranks, run as replicas (``ComputeConfig(runtime_ngpus=...)``):
    each replica trains its share of the batch (at least :data:`PIPELINE_MICROBATCHES` micro-batches of
    the model's batches per replica) by ``train_step``; the replicas' gradients are averaged once, after
    the last micro-batch, with the exact whole-batch weighting ``(loss_sum, count)`` over replicas. So
    the reference is one device on the WHOLE batch (every replica's share), as for micro-batches
    (``verify/cases/microbatch.py``), not the mean of the shares' losses. ZeRO works over the replicas
    and each stage's dp axis; the sharded checkpoint (replicas write their pieces once) resumes on one
    device, under another pipeline and under another plan (``verify/cases/resume.py``)."""
    replicas, replica = world_size // plan_ngpus, dist.get_rank() // plan_ngpus
    m = max(recipe.num_microbatches, PIPELINE_MICROBATCHES)
    t = Training(name, seed, world_size, steps, groups, gen_dir, dtype, dt, with_buckets(recipe, case, num_microbatches=m),
                 case, traces)
    return train(t, PipelineReplicated(policy, resolve_policy, plan_ngpus, replicas), ReplicaShare(m * replicas, replicas, replica),
                 TrainStep(loss_fn_of(case)), MeanOfShares(recipe, LOSS, Precision.of(recipe).active))


def _mean_loss(model: torch.nn.Module, args: tuple) -> torch.Tensor:
    """The mean of ``model``'s losses over the shares ``args[0]`` (each cast to the model's dtype)."""
    dt = next(model.parameters()).dtype
    return sum(model(*cast(a, dt)) for a in args[0]) / len(args[0])


@dataclass(frozen=True)
class MeanOfShares:
    """One device for replicas (the computing rank's ``models``,
    :func:`~verify.cases.reference.reference_models`): the mean of the losses of ``refs`` (each share, or
    the whole batch alone) and its gradients, with the ``recipe``'s steps done as one device does them
    (``verify/cases/recipe_steps.py``: torch's own clipping; the parallel module clipped already); the
    point is the parameters alone."""

    recipe: Recipe
    loss_name: str
    lowprec: bool = False  # a low-precision recipe: no kink explanation (its own rule)
    initial = False  # no initial-state checks
    tolerant = False  # a point that does not load raises

    def start(self, models) -> tuple[dict, list[str]]:
        state = self.state(models)
        return state, list(state)

    def state(self, models) -> dict:
        return {n: p.detach().clone() for n, p in models[2].items()}

    def step(self, models, refs: list, step: int, point: dict, fallback: Float64Fallback) -> dict:
        ref, ref64, params, _ = models
        load_like(ref64, ref)
        before = held(ref)  # what its forward writes into them: every buffer is checked after the step
        sides = KinkSides(fallback)  # float64 takes the run's side of a kink where within rounding
        with sides.record():
            loss_ref = _mean_loss(ref, (refs,))
        loss_ref.backward()
        with fallback, sides.follow():  # an operator without a float64 kernel runs in the test dtype (the bound widens)
            loss64 = _mean_loss(ref64, (refs,))
            loss64.backward()
        apply_steps(self.recipe, ref.parameters())  # the single-device recipe: torch's own clipping, ...
        apply_steps(self.recipe, ref64.parameters())
        grads, grads64 = reference_grads(params, ref64)
        return require_finite({"loss": loss_ref.detach(), "loss64": loss64.detach(), "grads": grads,
                               "grads64": grads64, **reference_buffers(ref, ref64, before)}, step)

    def kinks(self, models, refs: list, step: int, fallback: Float64Fallback, reference):
        """Where a gradient check of the step fails: values within rounding of a kink explained
        (:func:`verify.cases.kinks.rescue`) on the mean of the shares' losses; none under a low precision."""
        if self.lowprec:
            return None
        return explainer(step, reference, lambda: models[:2], _mean_loss, (refs,), fallback,
                         contextlib.nullcontext, self.recipe)

    def reloads(self, *_) -> list[Check]:
        return []

    def finish(self, fallback: Float64Fallback) -> None:
        pass
