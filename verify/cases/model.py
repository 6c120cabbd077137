"""One rank's part of a whole-model case: compile with ``nnscaler.parallelize``, train a few AdamW
steps, and judge each step in two parts (see ``verify/judge/compare.py``): the loss and every gradient of
the single-device model at the single-device run's parameters, and the parallel optimizer's update
against AdamW on one device from the same point; then the merged checkpoint, reloaded strictly on one
device and under another plan."""
from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from nnscaler.policies import POLICIES, ComputeConfig, PlanError
from nnscaler.recipe import Recipe
from nnscaler.runtime.mesh import GroupCache

from verify.cases.batch import cast
from verify.cases.buffers import buffer_checks, buffer_names, held, reference_buffers
from verify.judge.dtypes import convert_state, to_dtype
from verify.cases.memory import MemoryLog, SavedActivations, measure, storage_bytes
from verify.cases.resume import resume_checks
from verify.cases.pipeline import is_pipeline_policy, pipeline_microbatches
from verify.cases.precision_record import PrecisionRecord
from verify.models.loader import file_tag
from verify.user_files import import_once
from verify.judge.verdict import check_deterministic
from verify.cases.draws import check_draws, same_draws
from verify.cases.compiled import compile_case
from verify.judge.lowprec import Precision
from verify.config import recipe_tag
from verify.judge.compare import Check, Float64Fallback, check_tensor, check_update
from verify.judge.finite import require_finite
from verify.cases.microbatch import loss_fn_of, one_device_loss, whole_batch
from verify.cases.fresh import built_like
from verify.cases.spread import moved_samples
from verify.cases.kinks import KinkSides, rescue, step_flips
from verify.cases.reference import SharedReference, reference_grads
from verify.models.loader import build_model
from verify.cases.samples import DTYPES
from verify.cases.traces import TraceCache, tracer_of

LR = 1e-2


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


def own_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` without aliases: a tied tensor goes by its first name only (as
    ``named_parameters()`` and the compiled module name it)."""
    seen, out = set(), {}
    for k, v in model.state_dict(keep_vars=True).items():
        if id(v) not in seen:
            seen.add(id(v))
            out[k] = v.detach()
    return out


def _with_aliases(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (first names only) completed with every alias ``model.state_dict()`` lists."""
    first: dict[int, str] = {}
    for k, v in model.state_dict(keep_vars=True).items():
        first.setdefault(id(v), k)
    return {k: state[first[id(v)]] for k, v in model.state_dict(keep_vars=True).items() if first[id(v)] in state}


def expected_checks(name: str, policy: str, steps: int, seed: int, checkpoint: bool = True,
                    clip: float | None = None) -> list[str]:
    """The names of every check a rank must return for this case (a short list is a failure); with
    ``clip``, each step's total gradient norm too. A tuple stands for one of its names (the reload
    under the first plan that fits, :func:`reload_check_names`)."""
    model = build_model(name, seed).model
    names = [f"initial {k}" for k in own_state(model)]
    params = [n for n, _ in model.named_parameters()]
    buffers = buffer_names(model)
    for s in range(steps):
        names += [f"load step {s}", f"loss step {s}", *([f"grad norm step {s}"] if clip is not None else []),
                  *(f"grad {n} step {s}" for n in params),
                  *(f"param {n} after step {s}" for n in params),
                  *(f"buffer {n} after step {s}" for n in buffers)]
    if not checkpoint:
        return names
    return names + ["checkpoint keys", "loss of the checkpoint on one device", reload_check_names(policy)]


def _equal(name: str, par, want) -> Check:
    if par is None:
        return Check(name, float("inf"), 0.0, False, "the parallel module does not hold it")
    if par.shape != want.shape or par.dtype != want.dtype:
        return Check(name, float("inf"), 0.0, False, f"{tuple(par.shape)} {par.dtype} != {tuple(want.shape)} {want.dtype}")
    err = float((par.double() - want.double()).abs().max()) if par.numel() else 0.0
    ok = torch.equal(par, want)
    return Check(name, err, 0.0, ok, "" if ok else f"differs from the model's own tensor by {err:.3g}")


def installed(pm, point: dict, step: int) -> Check:
    """What ``load_state_dict`` installed in the parallel module equals what it was given, bit for bit
    (a load that installs nothing leaves the module's own parameters, which differ from the point by
    rounding alone: the step's other checks would pass)."""
    state = pm.state_dict()
    checks = [_equal(n, state.get(n), want) for n, want in point.items() if n in state]
    bad = [c for c in checks if not c.ok]
    return Check(f"load step {step}", max((c.err for c in bad), default=0.0), 0.0, not bad,
                 f"{bad[0].name}: {bad[0].reason}" if bad else "")


def _parallelize(model, args, policy, config, groups, gen_dir: Path, tracer=None, announce: bool = True):
    return compile_case(model, args, resolve_policy(policy), config, groups, gen_dir, tracer, announce)


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
    The single-device runs mimic the recipe: they clip with ``torch.nn.utils.clip_grad_norm_`` (each
    step's total norm is checked) and run its precision (:class:`~verify.judge.lowprec.Precision`).
    ``memory``: where the last step's measured memory on this rank is left (:mod:`verify.cases.memory`).
    ``layout``: more :class:`ComputeConfig` fields (a lowered cluster plan's tp_size, pp_size, schedule, ...)."""
    clip, precision = recipe.clip_grad_norm, Precision.of(recipe)
    dt = DTYPES[dtype]
    microbatches = pipeline_microbatches(policy, recipe.num_microbatches)
    case = build_model(name, seed)
    to_dtype(case.model, dt)
    reference = SharedReference.of(groups, world_size)  # computed on the case's rank 0 (verify/cases/reference.py)
    if reference.computes:
        ref = precision.reference(built_like(name, seed, case.model, dt))
        ref64 = built_like(name, seed, case.model, torch.float64)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    recipe = replace(recipe, num_microbatches=microbatches,
                     bucket_bytes=case.bucket_bytes if recipe.bucket_bytes is None else recipe.bucket_bytes)
    config = ComputeConfig(world_size, **{"tp_size": 2 if world_size % 2 == 0 else 1, **(layout or {})}, seed=seed,
                           recipe=recipe)
    tag = policy.replace("/", "_").replace(":", "-").replace("@", "_") + recipe_tag(recipe)
    batch = (lambda step: whole_batch(case.batch, step, microbatches)) if microbatches > 1 else case.batch
    loss_fn = loss_fn_of(case)
    pm = _parallelize(case.model, cast(batch(0), dt), policy, config, groups,
                      Path(gen_dir) / f"{file_tag(name)}-{tag}-w{world_size}-{dtype}-s{seed}", tracer_of(traces, name))
    if microbatches > 1 or is_pipeline_policy(policy):
        check_deterministic(pm.graph, f"{microbatches} micro-batches")
    initial = pm.state_dict()
    start, names = reference.share(lambda: (_clone(own_state(ref)), [n for n, _ in ref.named_parameters()]))
    checks = [_equal(f"initial {k}", initial.get(k), v) for k, v in start.items()]
    shadow = {n: start[n].clone() for n in names}  # AdamW on one device, fed the parallel grads
    record = PrecisionRecord.of(recipe)  # the recipe's precision, checked structurally
    opts = [record.watch(pm.build_optimizer(torch.optim.AdamW, lr=LR))]  # sharded over the data-parallel ranks under zero
    opts += [torch.optim.AdamW(shadow.values(), lr=LR)]
    fallback = Float64Fallback(dt, lowprec=precision.active)

    def one_device_step(args: tuple, step: int, point: dict) -> dict:
        """The step on one device (the computing rank): the recipe's and float64's loss and gradients
        at ``point`` (where ``ref`` is), the moved points' spreads, the clipped norms."""
        ref64.load_state_dict(_with_aliases(ref64, convert_state(point, torch.float64)), strict=True)
        before = held(ref)  # what its forward writes into them: every buffer is checked after the step
        loss_ref, loss64 = _losses(ref, ref64, args, seed, step, fallback,
                                   lambda m, a: one_device_loss(m, a, microbatches, case))
        require_finite({"loss": loss_ref, "loss64": loss64}, step)  # the model's own fault: an error row
        if precision.active:  # more samples of the recipe's own rounding error (verify/cases/spread.py)
            moved_samples(ref, ref64, lambda m, a: one_device_loss(m, a, microbatches, case), args,
                          cast(args, torch.float64), seed, step, fallback)
        out = {"loss": loss_ref.detach(), "loss64": loss64.detach()}
        if clip is not None:  # the single-device recipe: torch's own clipping of the whole model
            out["norm"] = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).detach()
            out["norm64"] = torch.nn.utils.clip_grad_norm_(ref64.parameters(), clip).detach()
        return require_finite(dict(out, **_grads(ref, ref64), **reference_buffers(ref, ref64, before)), step)

    for step in range(steps):
        args = cast(batch(step), dt)
        point = {k: v.clone() for k, v in start.items()} if step == 0 else \
            reference.share(lambda: _clone(own_state(ref)))
        try:  # strict: every key of the module's own state_dict
            pm.load_state_dict({k: point.get(k, v) for k, v in pm.state_dict().items()})
        except (RuntimeError, KeyError) as exc:  # the rest of the case cannot run: its checks go missing
            return checks + [Check(f"load step {step}", float("inf"), 0.0, False, f"{type(exc).__name__}: {exc}")]
        checks.append(installed(pm, point, step))
        saved = SavedActivations(pm.parameters())  # measured memory per rank (verify/cases/memory.py)
        with record:  # the dtypes the program's step reduces, sends and computes in (bf16-mixed only)
            with saved:
                if microbatches > 1 or is_pipeline_policy(policy):  # whole-batch loss and gradients of M micro-batches
                    loss = pm.train_step(*args, loss_fn=loss_fn)
                else:
                    with same_draws(seed, step):
                        loss = pm(*args)
            if not (microbatches > 1 or is_pipeline_policy(policy)):
                loss.backward()
                if clip is not None:  # what train_step does with ComputeConfig(clip_grad_norm=...)
                    pm.clip_grad_norm_(clip)
        grad_bytes = storage_bytes(pm.grad_tensors()) if hasattr(pm, "grad_tensors") else None
        one = reference.share(lambda: one_device_step(args, step, point), fallback)
        widen, kw = fallback.widen, fallback.bounds()
        checks.append(check_tensor(f"loss step {step}", loss.detach(), one["loss"], one["loss64"], **kw))
        if clip is not None:
            got = pm.last_grad_norm
            checks.append(check_tensor(f"grad norm step {step}", None if got is None else got.detach().reshape(()),
                                       one["norm"], one["norm64"], **kw))
        kinks = None if precision.active else partial(
            rescue, step=step, reference=reference,
            contributions=lambda: step_flips(ref, ref64, lambda m, a: one_device_loss(m, a, microbatches, case), args,
                                             fallback, lambda: same_draws(seed, step), clip))
        checks += step_checks(pm, one["grads"], one["grads64"], shadow, point, opts, step, widen, kw, kinks,
                              buffers=one)
        if reference.computes:  # AdamW on one device: the next step's point
            ref_opt.step()
            ref_opt.zero_grad()
        if grad_bytes is not None and memory is not None:
            # train_step runs backward inside: its micro-batches' saved bytes add up, no peak to report
            memory.last = measure(pm, opts[0], None if microbatches > 1 else saved.bytes, grad_bytes)
    checks = record.checks(pm, opts[0], loss, one["loss"]) + checks  # a narrower dtype named first
    if checkpoint:
        checks += _reload_checks(name, policy, pm, cast(case.batch(steps), dt), groups, gen_dir, world_size,
                                 seed, dt, fallback, config.bucket_bytes, traces, precision, reference)
        checks += resume_checks(name, policy, world_size, seed, steps, pm, opts[0], groups, gen_dir, dt, traces,
                                precision, fallback.spreads, zero=recipe.zero)
    check_draws(fallback)  # a draw the float64 reference could not make the run's: unverifiable
    checks += fallback.notes(dtype, checks)
    return checks


def _clone(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


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


def _grads(ref: torch.nn.Module, ref64: torch.nn.Module) -> dict:
    """The gradients of both references by parameter name, for :func:`step_checks`."""
    grads, grads64 = reference_grads(dict(ref.named_parameters()), ref64)
    return {"grads": grads, "grads64": grads64}


def step_checks(pm, grads_ref: dict, grads64: dict, shadow: dict, point: dict, opts: list, step: int,
                widen: float, kw: dict, kinks: Callable | None = None, buffers: dict | None = None) -> list[Check]:
    """The checks of one training step after its backward: the gradient of every parameter of the
    single-device model (its gradients in the recipe's dtype ``grads_ref`` and in float64 ``grads64``,
    by name), then AdamW on one device applied to the parallel gradients from ``point`` (in
    ``shadow``, stepped by ``opts``) against the parallel module's parameters after its own step. Under
    a clipping recipe the parallel gradients are the clipped ones already (checked against the
    single-device clipped gradients), so the shadow steps them as they are: clipping them again would
    scale them by ``max / (max + 1e-6)`` once more, an update error of ``lr * 1e-6 / max`` where
    AdamW's ``eps`` is of the gradient's size (a false alarm at ``max = 0.1``). ``kinks(checks, grads,
    judge)``: where the gradient checks failed, their verdict with values near a kink explained
    (:func:`verify.cases.kinks.rescue`); every rank of the case calls it. With ``buffers`` (the
    single-device step's :func:`~verify.cases.buffers.reference_buffers`), every buffer after the step too."""
    grads = pm.whole_grads()
    scale = max((float(g.abs().max()) for g in grads64.values() if g is not None), default=0.0)

    def judge(n: str, got) -> Check:
        return check_tensor(f"grad {n} step {step}", got, grads_ref[n], grads64[n], scale=scale, **kw)

    checks = [judge(n, grads.get(n)) for n in grads_ref]
    if kinks is not None:
        checks = kinks(checks, {n: grads.get(n) for n in grads_ref}, judge)
    for n, t in shadow.items():
        t.copy_(point[n])
        t.grad = None if grads.get(n) is None else grads[n].to(t.dtype).clone()
    for opt in opts:
        opt.step()
        opt.zero_grad()
    after = pm.state_dict()
    checks += [check_update(f"param {n} after step {step}", after.get(n), t, LR, widen) for n, t in shadow.items()]
    return checks + (buffer_checks(pm, after, buffers, step, kw) if buffers is not None else [])


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
        single.load_state_dict(_with_aliases(single, state), strict=True)
        single64 = built_like(name, seed, single, torch.float64)
        precision.reference(single)
        with torch.no_grad():
            with same_draws(seed, step), fallback.draws.recording():
                want = single(*args)
            with fallback, same_draws(seed, step):
                want64 = single64(*cast(args, torch.float64))
        require_finite({"loss": want, "loss64": want64}, step, " (the checkpoint's reload on the next batch)")
        return {"want": want, "want64": want64, "state": _clone({k: state[k] for k in own_state(single)})}

    one = reference.share(one_device, fallback)
    if "missing" in one:
        return [Check("checkpoint keys", float("inf"), 0.0, False, f"the checkpoint lacks {', '.join(one['missing'][:5])}")]
    other, why = None, []
    for other_policy in reload_policies(policy):  # the first plan that fits this batch and world size
        try:
            other = _parallelize(to_dtype(build_model(name, seed).model, dt), args, other_policy,
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
    differs = next((k for k, v in one["state"].items() if not _equal(k, state.get(k), v).ok), None)
    if differs is not None:  # this rank's merged state is not what the one device loaded
        why = f"this rank's merged state differs from rank {reference.src}'s, which the one device loaded ({differs})"
        return [Check("checkpoint keys", 0.0, 0.0, True)] + [Check(n, float("inf"), 0.0, False, why) for n in names]
    return [Check("checkpoint keys", 0.0, 0.0, True),
            check_tensor(names[0], got, one["want"], one["want64"], lowprec=fallback.lowprec),
            # none fits: the program under test is not at fault, the row says why (verify/judge/verdict.py)
            Check(NO_RELOAD_PLAN, 0.0, 0.0, True, "; ".join(why)) if other is None else
            check_tensor(names[1], other_loss, one["want"], one["want64"], lowprec=fallback.lowprec)]
