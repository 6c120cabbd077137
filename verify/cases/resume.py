"""The resume check every whole-model case runs: after training under plan A, checkpoint the model
and its AdamW state (sharded, ``nnscaler.checkpoint``), resume on one device (the merged single-file
export) and under plan B (another sharded policy, and from W=4 another world size, W=2); what is loaded must
equal what was saved bit for bit, and training on must be right step by step (see
:func:`resume_checks`). With the case's own checks (plan A against one device at every step), this
chains the resumed runs to single-device training that never stopped."""
from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from nnscaler import checkpoint
from nnscaler.checkpoint.format import plain
from nnscaler.policies import ComputeConfig

from verify.cases.compiled import compile_case
from verify.cases.draws import check_draws, same_draws
from verify.cases.batch import cast
from verify.judge.dtypes import to_dtype
from verify.models.loader import file_tag
from verify.judge.lowprec import Precision
from verify.judge.finite import require_finite
from verify.judge.compare import Check, Float64Fallback, SpreadHistory, check_tensor, check_update
from verify.cases.fresh import built_like, load_like
from verify.models.loader import build_model
from verify.cases.traces import TraceCache, tracer_of
from verify.cases.spread import moved_samples
from verify.cases.kinks import KinkSides, explainer
from verify.cases.reference import SharedReference, reference_grads

MORE_STEPS = 2


from verify.names import TWO_D_RESUME as TWO_D  # at W=4, these resume into a 2-D plan (a 2 x 2 mesh)


def plan_b(policy: str, world_size: int) -> tuple[str, int]:
    """Where a checkpoint of ``policy`` at ``world_size`` is resumed: another sharded plan (``tp``;
    a ``tp`` checkpoint under ``random``, which splits parameters along other dims), and a smaller
    world size where there is one (ranks of a case are 0 .. world_size-1); except that at W=4 a
    ``dp`` checkpoint resumes under ``hybrid`` and a ``tp`` one under ``random2d``, both on a 2 x 2
    mesh, so a load that takes one mesh axis's coordinate for the other's is caught."""
    if world_size == 4 and policy in TWO_D:
        return TWO_D[policy], 4
    return ("tp" if policy != "tp" else "random"), (2 if world_size >= 4 and world_size % 2 == 0 else world_size)


def zero_plan_b(policy: str, world_size: int, zero: int) -> tuple[str, int, int]:
    """Where a checkpoint of a ZeRO ``zero`` run is resumed: into a plan that shards its optimizer
    state too, so the sharded load itself is checked (a plan without ZeRO would load every moment whole
    and never cut one): :func:`plan_b`'s plan where ZeRO applies to it; else ``hybrid`` on 4 ranks (a dp
    axis of 2 cuts the moments elsewhere than 4 ranks do); else ``dp`` on half the ranks; else ``dp`` on
    the same ranks at another stage (3 for 1 and 2, 1 for 3: the state cut by another code path).
    Returns ``(policy, world size, zero stage)``."""
    from verify.cases.zero import zero_applies
    other, w_b = plan_b(policy, world_size)
    if zero_applies(other, w_b, zero=zero):
        return other, w_b, zero
    if world_size >= 4 and policy != "hybrid" and zero_applies("hybrid", 4, zero=zero):
        return "hybrid", 4, zero
    if world_size >= 4 and world_size % 2 == 0:
        return "dp", world_size // 2, zero
    return "dp", world_size, (1 if zero >= 3 else 3)


def _moments(model, opt, parallel: bool) -> dict[str, dict[str, torch.Tensor]]:
    if parallel and hasattr(model, "stages"):  # a pipeline: merged across its stages
        from nnscaler.checkpoint.pipeline import whole_moments
        return whole_moments(model, opt)
    names = {id(p): n for n, p in model.named_parameters()} if not parallel else {
        id(getattr(model, k)): n for k, n in model._names.items()}
    out = {}
    for p, st in (plain(opt).state if parallel else opt.state).items():  # a sharded optimizer's state gathered
        n = names[id(p)]
        out[n] = {k: (model._whole(n, v) if parallel and v.dim() else v) for k, v in st.items()}
    return out


def exact(name: str, got, want) -> Check:
    """A checkpoint moves data; nothing is computed, so loaded tensors equal saved ones bit for bit."""
    if got is None or want is None:
        return Check(name, float("inf"), 0.0, False, "missing after the load" if got is None else "not saved")
    if got.shape != want.shape or got.dtype != want.dtype:
        return Check(name, float("inf"), 0.0, False, f"{tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}")
    ok = torch.equal(got, want)
    err = 0.0 if ok else float((got.double() - want.double()).abs().max())
    return Check(name, err, 0.0, ok, "" if ok else f"differs from the saved tensor by {err:.3g}")


def _loaded_checks(where: str, params: dict, moments: dict, saved: dict, saved_moments: dict) -> list[Check]:
    checks = [exact(f"resumed {where}: param {n}", params.get(n), t) for n, t in saved.items()]
    for n, st in saved_moments.items():
        for k, t in st.items():
            checks.append(exact(f"resumed {where}: optimizer {k} of {n}", moments.get(n, {}).get(k), t))
    return checks


def pipeline_plan_b(policy: str, world_size: int, name: str | None = None, seed: int = 0) -> tuple[str, int]:
    """Where a pipeline's checkpoint is loaded into another pipeline: 2 tensor-parallel stages at W=4
    (pieces split in blocks, a fused qkv's, are cut on load); else at W=2 the interleaved pipeline
    (4 stages, cut elsewhere than 2 stages are), or one stage per rank when the checkpoint is the
    interleaved one's or model ``name`` has too few layers for 4 stages; at a world size that neither
    divides (3, 5, ...: the gang has no groups for them), one stage per rank at W."""
    from verify.cases.pipeline import pipeline_applies
    if policy != "pp2_tp" and world_size % 4 == 0:
        return "pp2_tp", 4
    if world_size % 2:
        return "pp", world_size
    if policy != "pp_interleaved" and pipeline_applies("pp_interleaved", 2, name, seed):
        return "pp_interleaved", 2
    return "pp", 2


def _pipeline_reload(name, policy, world_size, seed, path, groups, gen_dir, dtype, lr, saved,
                     saved_moments, traces: TraceCache | None = None, precision: Precision = Precision()) -> list[Check]:
    """The checkpoint loaded into a pipeline of another plan: parameters and AdamW moments, merged
    across its stages, equal what was saved bit for bit."""
    from verify.cases.pipeline import PIPELINE_MICROBATCHES
    from verify.cases.microbatch import whole_batch
    other, w_b = pipeline_plan_b(policy, world_size, name, seed)
    if dist.get_rank() >= w_b:
        return []
    case = build_model(name, seed)
    resumed = compile_case(to_dtype(case.model, dtype), cast(whole_batch(case.batch, 0, PIPELINE_MICROBATCHES), dtype), other,
                           ComputeConfig(w_b, seed=seed + 1, num_microbatches=PIPELINE_MICROBATCHES,
                                         **precision.config_kwargs()), groups,
                           Path(gen_dir) / f"{file_tag(name)}-reload-{other}-w{w_b}-{dtype}-s{seed}",
                           tracer_of(traces, name), announce=False)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=lr)
    checkpoint.load(path, resumed, resumed_opt)
    return _loaded_checks(f"under {other} at W={w_b}", resumed.state_dict(), _moments(resumed, resumed_opt, True),
                          saved, saved_moments)


def resume_checks(name: str, policy: str, world_size: int, seed: int, steps: int, pm, opt, groups, gen_dir: str,
                  dtype: torch.dtype, traces: TraceCache | None = None, precision: Precision = Precision(),
                  spreads: SpreadHistory | None = None, zero: int = 0) -> list[Check]:
    """Checkpoint ``pm`` and its AdamW ``opt`` after ``steps`` steps; load the merged export on one
    device and the sharded checkpoint under plan B; every parameter and optimizer moment must equal
    what was saved, bit for bit. Then train ``MORE_STEPS`` more steps: the run resumed on one device
    is the reference, and plan B is judged against it exactly as a whole-model case judges a plan
    (loss and gradients at the same parameters, against float64; each update against AdamW on one
    device fed plan B's gradients from the same state). ``spreads``: the training phase's record of
    single-device spreads (bf16 recipes, :class:`~verify.judge.compare.SpreadHistory`), continued here.
    ``zero``: the run's ZeRO stage; plan B then shards its optimizer state too (:func:`zero_plan_b`), and its
    moments and step after the load are compared, per parameter, bit for bit with what was saved."""
    rank = dist.get_rank()
    path = Path(gen_dir) / f"ckpt-{file_tag(name)}-{file_tag(policy)}-w{world_size}-s{seed}"
    group = pm.process_group
    if rank == 0 and path.exists():
        shutil.rmtree(path)
    dist.barrier(group=group)
    checkpoint.save(path, pm, opt)
    if rank == 0:
        checkpoint.export_merged(path, path / "merged.pt")
    dist.barrier(group=group)
    saved, saved_moments = {n: t for n, t in pm.state_dict().items()}, _moments(pm, opt, True)
    params = {n for n, _ in build_model(name, seed).model.named_parameters()}
    saved = {n: t for n, t in saved.items() if n in params}
    lr = opt.defaults["lr"]
    single = precision.reference(to_dtype(build_model(name, seed).model, dtype))  # the recipe's single-device run
    single_opt = torch.optim.AdamW(single.parameters(), lr=lr)
    checkpoint.load_single(path / "merged.pt", single, single_opt)
    checks = _loaded_checks("on one device", {n: p.detach() for n, p in single.named_parameters()},
                            _moments(single, single_opt, False), saved, saved_moments)
    if hasattr(pm, "stages"):  # a pipeline's checkpoint also loads into another pipeline
        checks += _pipeline_reload(name, policy, world_size, seed, path, groups, gen_dir, dtype, lr, saved,
                                   saved_moments, traces, precision)
    other, w_b, zero_b = zero_plan_b(policy, world_size, zero) if zero else (*plan_b(policy, world_size), 0)
    if rank >= w_b:
        return checks
    batch = build_model(name, seed).batch
    resumed = compile_case(to_dtype(build_model(name, seed).model, dtype), cast(batch(0), dtype), other,
                           ComputeConfig(w_b, tp_size=2 if w_b % 2 == 0 else 1, seed=seed + 1, zero=zero_b,
                                         **precision.config_kwargs()), groups,
                           Path(gen_dir) / (f"{file_tag(name)}-resume-{other}-w{w_b}-{dtype}-s{seed}"
                                            + (f"-zero{zero_b}" if zero_b else "")), tracer_of(traces, name),
                           announce=False)
    resumed_opt = resumed.build_optimizer(torch.optim.AdamW, lr=lr)  # sharded under zero_b
    checkpoint.load(path, resumed, resumed_opt)
    where = f"under {other}" + (f" zero{zero_b}" if zero_b else "") + f" at W={w_b}"
    checks += _loaded_checks(where, resumed.state_dict(), _moments(resumed, resumed_opt, True), saved,
                             saved_moments)
    shadow = built_like(name, seed, single, dtype)  # AdamW on one device, from the checkpoint, fed plan B's gradients
    shadow_opt = torch.optim.AdamW(shadow.parameters(), lr=lr)
    shadow_opt.load_state_dict(copy.deepcopy(single_opt.state_dict()))
    sp, hp = dict(single.named_parameters()), dict(shadow.named_parameters())
    reference = SharedReference.of(groups, w_b)  # the resumed run on one device: on rank 0 alone
    single64 = built_like(name, seed, single, torch.float64) if reference.computes else None
    fallback = Float64Fallback(dtype, lowprec=precision.active, spreads=spreads)  # an operator without a float64 kernel runs in the test dtype (bound widens)

    def one_device_step(args: tuple, step: int) -> dict:
        """The resumed step on one device (the computing rank), from where ``single`` is."""
        load_like(single64, single)
        sides = KinkSides(fallback)  # float64 takes the run's side of a kink where within rounding
        with same_draws(seed, step), fallback.draws.recording(), sides.record():
            loss_ref = single(*args)
        loss_ref.backward()
        with fallback, same_draws(seed, step), sides.follow():
            loss64 = single64(*cast(args, torch.float64))
            loss64.backward()
        if precision.active:  # more samples of the recipe's own rounding error (verify/cases/spread.py)
            moved_samples(single, single64, lambda m, a: m(*a), args, cast(args, torch.float64), seed, step, fallback)
        grads, grads64 = reference_grads(sp, single64)
        return require_finite({"loss": loss_ref.detach(), "loss64": loss64.detach(), "grads": grads,
                               "grads64": grads64}, step, f" of the run resumed {where}")

    for step in range(steps, steps + MORE_STEPS):
        args = cast(batch(step), dtype)
        point = reference.share(lambda: {n: p.detach().clone() for n, p in sp.items()})
        resumed.load_state_dict({k: point.get(k, v) for k, v in resumed.state_dict().items()})
        with same_draws(seed, step):
            loss = resumed(*args)
        loss.backward()
        one = reference.share(lambda: one_device_step(args, step), fallback)
        widen, kw = fallback.widen, fallback.bounds()
        checks.append(check_tensor(f"resumed {where}: loss step {step}", loss.detach(), one["loss"],
                                   one["loss64"], **kw))
        grads = resumed.whole_grads()
        scale = max((float(g.abs().max()) for g in one["grads64"].values() if g is not None), default=0.0)

        def judge(n: str, got) -> Check:
            return check_tensor(f"resumed {where}: grad {n} step {step}", got, one["grads"][n], one["grads64"][n],
                                scale=scale, **kw)

        grad_checks = [judge(n, grads.get(n)) for n in one["grads"]]
        if not precision.active:  # a failing step explained by near-kink values, or not (verify/cases/kinks.py)
            grad_checks = explainer(step, reference, lambda: (single, single64), lambda m, a: m(*a), args, fallback,
                                    lambda: same_draws(seed, step))(grad_checks, {n: grads.get(n) for n in one["grads"]},
                                                                    judge)
        checks += grad_checks
        with torch.no_grad():
            for n, t in hp.items():
                t.copy_(point[n])
                t.grad = None if grads.get(n) is None else grads[n].to(t.dtype).clone()
        for o in (resumed_opt, shadow_opt) + ((single_opt,) if reference.computes else ()):
            o.step()
            o.zero_grad()
        after = resumed.state_dict()
        checks += [check_update(f"resumed {where}: param {n} after step {step}", after.get(n), t.detach(), lr, widen)
                   for n, t in hp.items()]
    check_draws(fallback)  # a draw the float64 reference could not make the run's: unverifiable
    return checks
