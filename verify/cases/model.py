"""One rank's part of a whole-model case: compile with ``nnscaler.parallelize``, train a few AdamW
steps, and judge each step in two parts (see ``verify/judge/compare.py``): the loss and every gradient of
the single-device model at the single-device run's parameters, and the parallel optimizer's update
against AdamW on one device from the same point; then the merged checkpoint, reloaded strictly on one
device and under another plan."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from nnscaler.policies import POLICIES, ComputeConfig, PlanError
from nnscaler.recipe import Recipe
from nnscaler.runtime.mesh import GroupCache

from verify.cases.batch import cast
from verify.cases.buffers import buffer_names, held, reference_buffers
from verify.cases.compiled import compile_case
from verify.cases.draws import check_draws, same_draws
from verify.cases.fresh import built_like
from verify.cases.kinks import KinkSides, explainer
from verify.cases.memory import MemoryLog
from verify.cases.microbatch import loss_fn_of, one_device_loss
from verify.cases.pipeline import is_pipeline_policy, pipeline_microbatches
from verify.cases.recipe_steps import apply_steps, measured_names
from verify.cases.reference import SharedReference, reference_grads
from verify.cases.samples import DTYPES
from verify.cases.spread import moved_samples
from verify.cases.step_checks import clone_state, equal_check, own_state, with_aliases
from verify.cases.traces import TraceCache, tracer_of
from verify.cases.training import (ForwardBackward, OnAllRanks, Training, TrainStep, WholeBatch, built, train,
                                   with_buckets)
from verify.judge.compare import Check, Float64Fallback, check_tensor
from verify.judge.dtypes import convert_state, to_dtype
from verify.judge.finite import require_finite
from verify.judge.lowprec import Precision
from verify.models.loader import build_model, file_tag
from verify.user_files import import_once


class PolicyFileError(ValueError):
    """``--policy FILE.py:fn`` names no file or no function in it."""


def resolve_policy(spec: str) -> str | Callable:
    """A built-in policy name, or ``FILE.py:fn`` -> the function ``fn`` of that file."""
    if is_pipeline_policy(spec):
        return spec
    if spec in POLICIES or ":" not in spec:
        if spec not in POLICIES:
            raise PolicyFileError(f"unknown policy {spec!r}; built-in: {', '.join(sorted(POLICIES))}, "
                                  f"or FILE.py:function for your own")
        return spec
    path, _, fn = spec.rpartition(":")
    p = Path(path).resolve()
    if not p.is_file() or p.suffix != ".py":
        raise PolicyFileError(f"policy {spec!r}: {path} is not a Python file (give FILE.py:function)")
    func = getattr(import_once(p, f"verify_policy_{abs(hash(str(p)))}"), fn, None)  # once (verify/user_files.py)
    if not callable(func):
        raise PolicyFileError(f"policy {spec!r}: {path} has no function {fn!r} (it must be (graph, config) -> Plan)")
    return func


def _other_policy(policy: str) -> str:
    return "dp" if policy != "dp" else "tp"


RELOAD_POLICIES = ("dp", "tp", "hybrid", "random")
"""The plans a checkpoint may reload under, after :func:`_other_policy`'s (the first that fits the
batch and world size is used: ``dp`` cannot split a batch of 4 over 3 ranks)."""
NO_RELOAD_PLAN = "note: no other plan reloads the checkpoint"
"""A passing check (its reason: why none fits) where no plan of :data:`RELOAD_POLICIES` fits."""


def reload_policies(policy: str) -> list[str]:
    """The plans a checkpoint of ``policy`` is reloaded under, in the order tried."""
    other = _other_policy(policy)
    return [other, *(p for p in RELOAD_POLICIES if p not in (other, policy))]


def reload_check_names(policy: str) -> tuple[str, ...]:
    """The one reload check a rank returns, whichever plan fitted (:func:`expected_checks`' alternatives)."""
    return (*(f"loss of the checkpoint under {p}" for p in reload_policies(policy)), NO_RELOAD_PLAN)


def expected_checks(name: str, policy: str, steps: int, seed: int, checkpoint: bool = True,
                    recipe: Recipe = Recipe()) -> list[str]:
    """The names of every check a rank must return for this case (a short list is a failure); with a
    ``recipe`` whose steps measure something (clipping: each step's total gradient norm), that too. A tuple stands for one of its names (the reload
    under the first plan that fits, :func:`reload_check_names`)."""
    model = build_model(name, seed).model
    names = [f"initial {k}" for k in own_state(model)]
    params = [n for n, _ in model.named_parameters()]
    buffers = buffer_names(model)
    for s in range(steps):
        names += [f"load step {s}", f"loss step {s}", *measured_names(recipe, s),
                  *(f"grad {n} step {s}" for n in params),
                  *(f"param {n} after step {s}" for n in params),
                  *(f"buffer {n} after step {s}" for n in buffers)]
    if not checkpoint:
        return names
    return names + ["checkpoint keys", "loss of the checkpoint on one device", reload_check_names(policy)]


def run_model_job(job: dict, groups: GroupCache, traces: TraceCache | None = None,
                  memory: MemoryLog | None = None) -> list[Check]:
    """The checks of a ``model`` job (keys: model, policy, world_size, steps, seed, gen_dir, and
    optionally dtype, checkpoint, layout and recipe, :meth:`nnscaler.recipe.Recipe.to_dict`'s form);
    ``traces``: the rank's trace cache."""
    recipe = Recipe.from_dict(job.get("recipe"))
    return run_model_case(job["model"], job["policy"], job["world_size"], job["steps"], job["seed"], groups,
                          job["gen_dir"], dtype="bfloat16" if recipe.precision == "bf16-true" else job.get("dtype", "float32"),
                          recipe=recipe, checkpoint=job.get("checkpoint", True), traces=traces, memory=memory,
                          layout=job.get("layout"))


def run_model_case(name: str, policy: str, world_size: int, steps: int, seed: int, groups: GroupCache,
                   gen_dir: str, dtype: str = "float32", recipe: Recipe = Recipe(), checkpoint: bool = True,
                   traces: TraceCache | None = None, memory: MemoryLog | None = None,
                   layout: dict | None = None) -> list[Check]:
    """Checks for ``steps`` training steps of model ``name`` under ``policy`` on ``world_size`` ranks,
    under the training ``recipe`` (gradient-sync buckets default the model's). With
    ``recipe.num_microbatches`` M above 1 each step's batch is M of the model's batches stacked
    (:func:`~verify.cases.microbatch.whole_batch`), trained by ``train_step`` in M micro-batches and
    judged against one device on that whole batch. ``checkpoint=False`` leaves out the checkpoint
    reloads and the resume (the training checks alone, for benchmarks that sweep many cases).
    ``traces`` (a rank's :class:`~verify.cases.traces.TraceCache`) lets every compile of the case reuse one trace.
    The single-device runs mimic the recipe: its steps on the gradients as one device does them
    (``verify/cases/recipe_steps.py``: clipping by ``torch.nn.utils.clip_grad_norm_``, each step's total
    norm checked) and its precision (:class:`~verify.judge.lowprec.Precision`).
    ``memory``: where the last step's measured memory on this rank is left (:mod:`verify.cases.memory`).
    ``layout``: more :class:`ComputeConfig` fields (a lowered cluster plan's tp_size, pp_size, schedule, ...).
    The loop: :func:`verify.cases.training.train`."""
    dt = DTYPES[dtype]
    microbatches = pipeline_microbatches(policy, recipe.num_microbatches)
    case = built(name, seed, dt)
    t = Training(name, seed, world_size, steps, groups, gen_dir, dtype, dt,
                 with_buckets(recipe, case, num_microbatches=microbatches), case, traces, memory, checkpoint)
    whole = microbatches > 1 or is_pipeline_policy(policy)  # whole-batch loss and gradients of M micro-batches
    compiler = OnAllRanks(policy, resolve_policy, layout, f"{microbatches} micro-batches" if whole else None)
    stepper = TrainStep(loss_fn_of(case), measured=True) if whole else \
        ForwardBackward(seed=seed)
    return train(t, compiler, WholeBatch(microbatches), stepper, WholeModel(t, policy))


@dataclass(frozen=True)
class WholeModel:
    """One device for a model planned on all the case's ranks (the computing rank's ``models``:
    :func:`~verify.cases.reference.reference_models`): the recipe's and float64's loss and gradients
    at each step's point (its buffers too), from the step's draws, on the step's micro-batches; what the
    recipe's steps measure (the clipped norms); the moved points' spreads under a low precision; then the checkpoint's reloads."""

    t: Training
    policy: str
    initial = True  # the parallel module's initial state is checked
    tolerant = True  # a point that does not load ends the case (its checks go missing)
    loss_name = "loss step {}"

    def start(self, models) -> tuple[dict, list[str]]:
        return clone_state(own_state(models[0])), list(models[2])

    def state(self, models) -> dict:
        return clone_state(own_state(models[0]))

    def loss(self, model, args):
        return one_device_loss(model, args, self.t.recipe.num_microbatches, self.t.case)

    def step(self, models, args: tuple, step: int, point: dict, fallback: Float64Fallback) -> dict:
        ref, ref64, _, _ = models
        seed = self.t.seed
        ref64.load_state_dict(with_aliases(ref64, convert_state(point, torch.float64)), strict=True)
        before = held(ref)  # what its forward writes into them: every buffer is checked after the step
        loss_ref, loss64 = _losses(ref, ref64, args, seed, step, fallback, self.loss)
        require_finite({"loss": loss_ref, "loss64": loss64}, step)  # the model's own fault: an error row
        if Precision.of(self.t.recipe).active:  # more samples of the recipe's own rounding error (verify/cases/spread.py)
            moved_samples(ref, ref64, self.loss, args, cast(args, torch.float64), seed, step, fallback)
        out = {"loss": loss_ref.detach(), "loss64": loss64.detach()}
        # the single-device recipe: its steps on the gradients (torch's own clipping, ...), what they measured
        measured, measured64 = apply_steps(self.t.recipe, ref.parameters()), apply_steps(self.t.recipe, ref64.parameters())
        out["measured"] = {k: (v, measured64[k]) for k, v in measured.items()}
        grads, grads64 = reference_grads(dict(ref.named_parameters()), ref64)
        return require_finite(dict(out, grads=grads, grads64=grads64, **reference_buffers(ref, ref64, before)), step)

    def kinks(self, models, args: tuple, step: int, fallback: Float64Fallback, reference: SharedReference):
        """Where a gradient check of the step fails: values within rounding of a kink explained
        (:func:`verify.cases.kinks.rescue`; ``models`` computed on the reference's rank); none under a
        low precision."""
        if Precision.of(self.t.recipe).active:
            return None
        seed = self.t.seed
        return explainer(step, reference, lambda: models[:2], self.loss, args, fallback,
                         lambda: same_draws(seed, step), self.t.recipe)

    def reloads(self, t: Training, pm, reference: SharedReference, fallback: Float64Fallback) -> list[Check]:
        return _reload_checks(t.name, self.policy, pm, cast(t.case.batch(t.steps), t.dt), t.groups, t.gen_dir,
                              t.world_size, t.seed, t.dt, fallback, t.recipe.bucket_bytes, t.traces,
                              Precision.of(t.recipe), reference)

    def finish(self, fallback: Float64Fallback) -> None:
        check_draws(fallback)  # a draw the float64 reference could not make the run's: unverifiable


def _losses(ref, ref64, args: tuple, seed: int, step: int, fallback: Float64Fallback, run) -> tuple:
    """The loss of ``ref`` and of ``ref64`` (under ``fallback``) on ``args`` by ``run(model, args)``,
    each from the step's draws, backward run."""
    sides = KinkSides(fallback)  # float64 takes the run's side of a kink where within rounding (verify/cases/kinks.py)
    with same_draws(seed, step), fallback.draws.recording(), sides.record():  # micro-batched: the same micro-batches
        loss_ref = run(ref, args)
    loss_ref.backward()
    with fallback, same_draws(seed, step), sides.follow():
        loss64 = run(ref64, cast(args, torch.float64))
        loss64.backward()
    return loss_ref, loss64


def _reload_checks(name, policy, pm, args, groups, gen_dir, world_size, seed, dt, fallback,
                   bucket_bytes, traces: TraceCache | None = None, precision: Precision = Precision(),
                   reference: SharedReference = SharedReference()) -> list[Check]:
    """The merged checkpoint loads strictly into the single-device model and into a module under
    another plan; each computes the loss of the next batch as the parallel module does. The single
    device (``reference``'s computing rank) loads that rank's merged state; any other rank's must
    equal it bit for bit, or its reload checks fail."""
    state = pm.state_dict()
    step = -1  # the reloads' own draws

    def one_device() -> dict:
        single = to_dtype(build_model(name, seed).model, dt)
        missing = [k for k in own_state(single) if k not in state]
        if missing:
            return {"missing": missing}
        single.load_state_dict(with_aliases(single, state), strict=True)
        single64 = built_like(name, seed, single, torch.float64)
        precision.reference(single)
        with torch.no_grad():
            with same_draws(seed, step), fallback.draws.recording():
                want = single(*args)
            with fallback, same_draws(seed, step):
                want64 = single64(*cast(args, torch.float64))
        require_finite({"loss": want, "loss64": want64}, step, " (the checkpoint's reload on the next batch)")
        return {"want": want, "want64": want64, "state": clone_state({k: state[k] for k in own_state(single)})}

    one = reference.share(one_device, fallback)
    if "missing" in one:
        return [Check("checkpoint keys", float("inf"), 0.0, False, f"the checkpoint lacks {', '.join(one['missing'][:5])}")]
    other, why = None, []
    for other_policy in reload_policies(policy):  # the first plan that fits this batch and world size
        try:
            other = compile_case(to_dtype(build_model(name, seed).model, dt), args, resolve_policy(other_policy),
                                 ComputeConfig(world_size, seed=seed + 1, bucket_bytes=bucket_bytes,
                                               **precision.config_kwargs()),
                                 groups, Path(gen_dir) / f"{file_tag(name)}-reload-w{world_size}-{dt}-s{seed}",
                                 tracer_of(traces, name), announce=False)
            break
        except PlanError as exc:  # e.g. dp cannot split a batch of 4 over 3 ranks: the next plan
            why.append(f"{other_policy}: {exc}")
    if other is not None:
        other.load_state_dict({k: state.get(k, v) for k, v in other.state_dict().items()})
    with torch.no_grad():
        with same_draws(seed, step):
            got = pm(*args)
        if other is not None:
            with same_draws(seed, step):
                other_loss = other(*args)
    names = ["loss of the checkpoint on one device",
             NO_RELOAD_PLAN if other is None else f"loss of the checkpoint under {other_policy}"]
    differs = next((k for k, v in one["state"].items() if not equal_check(k, state.get(k), v).ok), None)
    if differs is not None:  # this rank's merged state is not what the one device loaded
        why = f"this rank's merged state differs from rank {reference.src}'s, which the one device loaded ({differs})"
        return [Check("checkpoint keys", 0.0, 0.0, True)] + [Check(n, float("inf"), 0.0, False, why) for n in names]
    return [Check("checkpoint keys", 0.0, 0.0, True),
            check_tensor(names[0], got, one["want"], one["want64"], lowprec=fallback.lowprec),
            # none fits: the program under test is not at fault, the row says why (verify/judge/verdict.py)
            Check(NO_RELOAD_PLAN, 0.0, 0.0, True, "; ".join(why)) if other is None else
            check_tensor(names[1], other_loss, one["want"], one["want64"], lowprec=fallback.lowprec)]
