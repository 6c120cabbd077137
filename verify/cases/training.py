"""The one training loop of a whole-model case: the model built once, compiled, trained ``steps``
AdamW steps judged against one device (computed on the case's first rank, ``verify/cases/reference.py``),
each step-like recipe field (clipping, ...) done as one device does it (``verify/cases/recipe_steps.py``)
and what it measures checked, its memory measured, then its checkpoint resumed (``verify/cases/resume.py``).

What varies is a small strategy each: how to compile (:class:`OnAllRanks`, :class:`Replicated`,
:class:`PipelineReplicated`), how to feed (:class:`WholeBatch`, :class:`ReplicaShare`; micro-batches
are M of the model's batches stacked), how to step (:class:`ForwardBackward`, :class:`TrainStep`) and
what one device computes (a ``one`` strategy: ``WholeModel`` in ``verify/cases/model.py``,
``MeanOfShares`` in ``verify/cases/replicas.py``). Each step is judged by ``verify/cases/step_checks.py``."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from nnscaler.policies import ComputeConfig
from nnscaler.recipe import Recipe
from nnscaler.runtime.grad_steps import after_backward
from nnscaler.runtime.mesh import GroupCache

from verify.cases.batch import cast, share
from verify.cases.compiled import compile_case
from verify.cases.draws import same_draws
from verify.cases.memory import MemoryLog, SavedActivations, measure, storage_bytes
from verify.cases.microbatch import whole_batch
from verify.cases.precision_record import PrecisionRecord
from verify.cases.recipe_steps import active
from verify.cases.reference import SharedReference, reference_models
from verify.cases.resume import resume_checks
from verify.cases.step_checks import LR, equal_check, installed, step_checks
from verify.cases.traces import TraceCache, tracer_of
from verify.config import recipe_tag
from verify.judge.compare import Check, Float64Fallback, check_tensor
from verify.judge.dtypes import to_dtype
from verify.judge.lowprec import Precision
from verify.judge.verdict import check_deterministic
from verify.models.loader import build_model, file_tag
from verify.models.registry import ModelCase


def built(name: str, seed: int, dt: torch.dtype) -> ModelCase:
    """Model ``name``'s case for ``seed``, its model in ``dt``: built once, handed on to every strategy."""
    case = build_model(name, seed)
    to_dtype(case.model, dt)  # complex buffers stay complex (verify/judge/dtypes.py)
    return case


def with_buckets(recipe: Recipe, case: ModelCase, **more) -> Recipe:
    """``recipe`` with the model's gradient-sync buckets unless it names its own (and ``more`` fields)."""
    return replace(recipe, **more, bucket_bytes=case.bucket_bytes if recipe.bucket_bytes is None else recipe.bucket_bytes)


@dataclass(frozen=True)
class Training:
    """A training case: model ``name`` (its ``case`` built once), where it runs, in what, for how long."""

    name: str
    seed: int
    world_size: int
    steps: int
    groups: GroupCache
    gen_dir: str
    dtype: str  # the row's dtype name (the generated folder, the notes)
    dt: torch.dtype  # what the case runs in
    recipe: Recipe  # with the case's micro-batches and buckets
    case: ModelCase
    traces: TraceCache | None = None
    memory: MemoryLog | None = None
    checkpoint: bool = True


# -- how to compile ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OnAllRanks:
    """The plan made for every rank of the case (``layout``: more :class:`ComputeConfig` fields);
    ``resolve`` turns the policy's name into what ``parallelize`` takes, when it compiles."""

    policy: str
    resolve: Callable[[str], object]
    layout: dict | None = None
    deterministic: str | None = None  # why the plan must be deterministic, if it must
    announce: bool = True

    @property
    def resume_policy(self) -> str:
        return self.policy

    def compile(self, t: Training, args: tuple):
        config = ComputeConfig(t.world_size, **{"tp_size": 2 if t.world_size % 2 == 0 else 1, **(self.layout or {})},
                               seed=t.seed, recipe=t.recipe)
        tag = self.policy.replace("/", "_").replace(":", "-").replace("@", "_") + recipe_tag(t.recipe)
        return compile_case(t.case.model, args, self.resolve(self.policy), config, t.groups,
                            Path(t.gen_dir) / f"{file_tag(t.name)}-{tag}-w{t.world_size}-{t.dtype}-s{t.seed}",
                            tracer_of(t.traces, t.name), self.announce)


@dataclass(frozen=True)
class Replicated:
    """A plan for ``plan_ngpus`` ranks run as ``replicas`` data-parallel replicas of it."""

    policy: str
    resolve: Callable[[str], object]
    plan_ngpus: int
    replicas: int

    @property
    def deterministic(self) -> str:
        return f"{self.replicas} data-parallel replicas"

    @property
    def resume_policy(self) -> str:
        return self.policy

    def config(self, t: Training) -> ComputeConfig:
        return ComputeConfig(self.plan_ngpus, runtime_ngpus=t.world_size, seed=t.seed, recipe=t.recipe)

    def compile(self, t: Training, args: tuple):
        tag = f"{file_tag(t.name)}-{file_tag(self.policy)}{recipe_tag(t.recipe)}-p{self.plan_ngpus}" \
              f"-w{t.world_size}-{t.dtype}-s{t.seed}"
        return compile_case(t.case.model, args, self.resolve(self.policy), self.config(t), t.groups,
                            Path(t.gen_dir) / tag, tracer_of(t.traces, t.name))


class PipelineReplicated(Replicated):
    """A pipeline planned on ``plan_ngpus`` ranks (tensor-parallel pairs where they divide), replicated."""

    @property
    def deterministic(self) -> str:
        return f"{self.replicas} replicas of a pipeline"

    @property
    def resume_policy(self) -> str:
        return f"{self.policy}-x{self.replicas}"

    def config(self, t: Training) -> ComputeConfig:
        return ComputeConfig(self.plan_ngpus, runtime_ngpus=t.world_size, seed=t.seed,
                             tp_size=2 if self.plan_ngpus % 2 == 0 else 1, recipe=t.recipe)


# -- how to feed ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WholeBatch:
    """Each step's batch is ``stacked`` of the model's batches (micro-batches), cast; every rank runs
    all of it, and so does one device."""

    stacked: int = 1

    def batch(self, t: Training, step: int) -> tuple:
        return cast(whole_batch(t.case.batch, step, self.stacked), t.dt)

    def mine(self, args: tuple) -> tuple:
        return args

    def theirs(self, args: tuple):
        return args

    def compiled(self, pm) -> "WholeBatch":
        """The feed for the module compiled (itself)."""
        return self


@dataclass(frozen=True)
class ReplicaShare(WholeBatch):
    """Each replica runs its share of the step's batch; one device runs the whole batch, or, ``per_share``,
    each share (the data-parallel objective: the mean of the shares' losses)."""

    replicas: int = 1
    replica: int = 0
    per_share: bool = False

    def mine(self, args: tuple) -> tuple:
        return share(args, self.replica, self.replicas)

    def theirs(self, args: tuple) -> list:
        return [share(args, r, self.replicas) for r in range(self.replicas)] if self.per_share else [args]

    def compiled(self, pm) -> "ReplicaShare":
        """Per share unless the model's forward writes a buffer: then one device runs the whole batch in one
        forward, as the replicas run theirs (once each per step, a statistic over every replica's rows)."""
        return replace(self, per_share=False) if self.per_share and getattr(pm, "graph", None) is not None \
            and pm.graph.writes else self


# -- how to step ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ran:
    """What the parallel step gave: the loss judged, and what it measured (``None``: nothing)."""

    loss: torch.Tensor
    activations: int | None = None
    grad_bytes: int | None = None


def _grad_bytes(pm) -> int | None:
    return storage_bytes(pm.grad_tensors()) if hasattr(pm, "grad_tensors") else None


@dataclass(frozen=True)
class ForwardBackward:
    """Forward (under the step's draws of ``seed``, if given), backward, then the recipe's steps on the
    gradients as ``train_step`` does them (clipping, ...: :func:`nnscaler.runtime.grad_steps.after_backward`);
    the saved activations measured. ``mean_over`` (the group cache and one replica rank per replica): the
    loss judged is the mean over replicas."""

    seed: int | None = None
    mean_over: tuple[GroupCache, list[int]] | None = None

    def run(self, pm, args: tuple, step: int) -> Ran:
        saved = SavedActivations(pm.parameters())  # measured memory per rank (verify/cases/memory.py)
        with saved, (same_draws(self.seed, step) if self.seed is not None else nullcontext()):
            loss = pm(*args)
        loss.backward()
        after_backward(pm)
        grad_bytes = _grad_bytes(pm)
        if self.mean_over is None:
            return Ran(loss.detach(), saved.bytes, grad_bytes)
        groups, ranks = self.mean_over
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=groups.get(ranks))
        return Ran(mean / len(ranks), saved.bytes, grad_bytes)


@dataclass(frozen=True)
class TrainStep:
    """``train_step`` (its micro-batches, its clipping); ``measured``: its gradients' bytes measured (its
    micro-batches' saved activations add up: no peak to report)."""

    loss_fn: Callable | None
    measured: bool = False

    def run(self, pm, args: tuple, step: int) -> Ran:
        if not self.measured:
            return Ran(pm.train_step(*args, loss_fn=self.loss_fn).detach())
        with SavedActivations(pm.parameters()):
            loss = pm.train_step(*args, loss_fn=self.loss_fn)
        return Ran(loss.detach(), None, _grad_bytes(pm))


# -- the loop ------------------------------------------------------------------------------------------
def train(t: Training, compiler, feed: WholeBatch, stepper, one) -> list[Check]:
    """Every check of training case ``t``, compiled by ``compiler``, fed by ``feed``, stepped by
    ``stepper``, against what ``one`` computes on one device (``one.step``), in order: the initial
    state (where ``one.initial``), per step the point installed, the loss (``one.loss_name``), what the
    recipe's steps measure (where one device gives ``measured``: the clipped norm), every gradient (a failing one explained by values
    near a kink where ``one.kinks`` gives the means) and parameter; then (``t.checkpoint``)
    ``one.reloads`` and the resume; ``one.finish``; the fallback's notes. The recipe's precision is
    recorded around each parallel step and its checks (:mod:`verify.cases.precision_record`) come first. A point that does not load
    ends the case there where ``one.tolerant`` (its checks go missing), else raises."""
    precision = Precision.of(t.recipe)
    reference = SharedReference.of(t.groups, t.world_size)  # computed on the case's rank 0 (verify/cases/reference.py)
    models = reference_models(t.name, t.seed, t.case.model, t.dt, precision, LR) if reference.computes else None
    pm = compiler.compile(t, feed.mine(feed.batch(t, 0)))
    feed = feed.compiled(pm)
    if compiler.deterministic:
        check_deterministic(pm.graph, compiler.deterministic)
    initial = pm.state_dict() if one.initial else {}
    start, names = reference.share(lambda: one.start(models))
    checks = [equal_check(f"initial {k}", initial.get(k), v) for k, v in start.items()] if one.initial else []
    shadow = {n: start[n].clone() for n in names}  # AdamW on one device, fed the parallel grads
    record = PrecisionRecord.of(t.recipe)  # the recipe's precision, checked structurally
    opts = [record.watch(pm.build_optimizer(torch.optim.AdamW, lr=LR))]  # sharded over the data-parallel ranks under zero
    opts += [torch.optim.AdamW(shadow.values(), lr=LR)]
    fallback = Float64Fallback(t.dt, lowprec=precision.active)
    for step in range(t.steps):  # judged as every whole-model case is (verify/judge/compare.py)
        args = feed.batch(t, step)
        point = {k: v.clone() for k, v in start.items()} if step == 0 else reference.share(lambda: one.state(models))
        try:  # strict: every key of the module's own state_dict
            pm.load_state_dict({k: point.get(k, v) for k, v in pm.state_dict().items()})
        except (RuntimeError, KeyError) as exc:  # the rest of the case cannot run: its checks go missing
            if not one.tolerant:
                raise
            return checks + [Check(f"load step {step}", float("inf"), 0.0, False, f"{type(exc).__name__}: {exc}")]
        checks.append(installed(pm, point, step))
        with record:  # the dtypes the program's step reduces, sends and computes in (bf16-mixed only)
            ran = stepper.run(pm, feed.mine(args), step)
        got = reference.share(lambda: one.step(models, feed.theirs(args), step, point, fallback), fallback)
        widen, kw = fallback.widen, fallback.bounds()
        checks.append(check_tensor(one.loss_name.format(step), ran.loss, got["loss"], got["loss64"], **kw))
        for s, _ in active(t.recipe) if "measured" in got else ():  # what the recipe's steps measured
            if s.measured is not None:
                value = s.parallel(pm)
                checks.append(check_tensor(s.measured.format(step), None if value is None else value.detach().reshape(()),
                                           *got["measured"][s.name], **kw))
        kinks = one.kinks(models, feed.theirs(args), step, fallback, reference)  # values near a kink explained
        checks += step_checks(pm, got["grads"], got["grads64"], shadow, point, opts, step, widen, kw, kinks,
                              buffers=got if "buffers" in got else None)  # where one device gives its buffers
        if reference.computes:  # AdamW on one device: the next step's point
            models[3].step()
            models[3].zero_grad()
        if ran.grad_bytes is not None and t.memory is not None:
            t.memory.last = measure(pm, opts[0], ran.activations, ran.grad_bytes)
    checks = record.checks(pm, opts[0], ran.loss, got["loss"]) + checks  # a narrower dtype named first
    if t.checkpoint:  # the checkpoint (optimizer state sharded under zero) resumes on one device and under another plan
        checks += one.reloads(t, pm, reference, fallback)
        checks += resume_checks(t.name, compiler.resume_policy, t.world_size, t.seed, t.steps, pm, opts[0], t.groups,
                                t.gen_dir, t.dt, t.traces, precision, fallback.spreads, zero=t.recipe.zero)
    one.finish(fallback)
    return checks + fallback.notes(t.dtype, checks)
