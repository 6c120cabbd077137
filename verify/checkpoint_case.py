"""The resume check every whole-model case runs: after training under plan A, checkpoint the model
and its AdamW state (sharded, ``nnscaler.checkpoint``), resume under plan B (another policy, and from
W=4 another world size, W=2) and on one device (the merged single-file export), train more steps, and
compare loss, every gradient, every parameter and the optimizer's moments with single-device
training that never stopped."""
from __future__ import annotations

import copy
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from nnscaler import checkpoint
from nnscaler.parallel import parallelize
from nnscaler.policies import ComputeConfig
from nnscaler.trace.build import UnknownOperatorWarning

from .compare import STATE_FACTOR, Check, check_tensor
from .models.builders import MODELS

MORE_STEPS = 2


def _f64(args: tuple) -> tuple:
    return tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def plan_b(policy: str, world_size: int) -> tuple[str, int]:
    """Where a checkpoint of ``policy`` at ``world_size`` is resumed: another policy, and a smaller
    world size where there is one (ranks of a case are 0 .. world_size-1)."""
    return ("tp" if policy != "tp" else "dp"), (2 if world_size >= 4 else world_size)


def _copy(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    twin = copy.deepcopy(model)
    twin_opt = type(opt)(twin.parameters(), lr=opt.defaults["lr"])  # hyperparameters come with the state
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    return twin, twin_opt


def resume_checks(name: str, policy: str, world_size: int, seed: int, steps: int, pm, opts, ref, ref64,
                  groups, gen_dir: str) -> list[Check]:
    """Checkpoint ``pm`` after ``steps`` steps and judge resumed training (see the module docstring).
    ``opts`` are the optimizers of ``pm``, ``ref`` and ``ref64``, in that order; none of them changes."""
    rank = dist.get_rank()
    path = Path(gen_dir) / f"ckpt-{name}-{policy}-w{world_size}-s{seed}"
    group = pm.process_group
    if rank == 0 and path.exists():
        shutil.rmtree(path)
    dist.barrier(group=group)
    checkpoint.save(path, pm, opts[0])
    if rank == 0:
        checkpoint.export_merged(path, path / "merged.pt")
    dist.barrier(group=group)
    (ref, ref_opt), (ref64, ref64_opt) = _copy(ref, opts[1]), _copy(ref64, opts[2])
    lr = opts[0].defaults["lr"]
    runs = {"on one device": None}
    single = MODELS[name](seed).model
    single_opt = torch.optim.AdamW(single.parameters(), lr=lr)
    checkpoint.load_single(path / "merged.pt", single, single_opt)
    other, w_b = plan_b(policy, world_size)
    resumed = resumed_opt = None
    if rank < w_b:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnknownOperatorWarning)
            resumed = parallelize(MODELS[name](seed).model, MODELS[name](seed).batch(0), other,
                                  ComputeConfig(w_b, tp_size=2 if w_b % 2 == 0 else 1, seed=seed + 1), groups=groups,
                                  gen_savedir=Path(gen_dir) / f"{name}-resume-{other}-w{w_b}-s{seed}")
        resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=lr)
        checkpoint.load(path, resumed, resumed_opt)
        runs[f"under {other} at W={w_b}"] = None
    batch = MODELS[name](seed).batch
    checks: list[Check] = []
    rp, rp64 = dict(ref.named_parameters()), dict(ref64.named_parameters())
    for step in range(steps, steps + MORE_STEPS):
        args = batch(step)
        loss_ref, loss64 = ref(*args), ref64(*_f64(args))
        loss_ref.backward()
        loss64.backward()
        scale = max(float(p.grad.abs().max()) for p in rp64.values() if p.grad is not None)
        for where, model, opt in (("on one device", single, single_opt), (f"under {other} at W={w_b}", resumed,
                                                                          resumed_opt)):
            if model is None:
                continue
            loss = model(*args)
            loss.backward()
            checks.append(check_tensor(f"resumed {where}: loss step {step}", loss.detach(), loss_ref.detach(),
                                       loss64.detach()))
            grads = model.whole_grads() if model is resumed else {n: p.grad for n, p in model.named_parameters()}
            for n in rp:
                checks.append(check_tensor(f"resumed {where}: grad {n} step {step}", grads.get(n), rp[n].grad,
                                           rp64[n].grad, scale=scale))
            opt.step()
            opt.zero_grad()
        for o in (ref_opt, ref64_opt):
            o.step()
            o.zero_grad()
        for where, model, opt in (("on one device", single, single_opt), (f"under {other} at W={w_b}", resumed,
                                                                          resumed_opt)):
            if model is not None:
                checks += _state_checks(where, step, model, opt, model is resumed, ref, ref_opt, ref64, ref64_opt)
    return checks


def _moments(model, opt, parallel: bool) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): n for n, p in model.named_parameters()} if not parallel else {
        id(getattr(model, k)): n for k, n in model._names.items()}
    out = {}
    for p, st in opt.state.items():
        n = names[id(p)]
        out[n] = {k: (model._whole(n, v) if parallel and v.dim() else v) for k, v in st.items()}
    return out


def _state_checks(where, step, model, opt, parallel, ref, ref_opt, ref64, ref64_opt) -> list[Check]:
    params = model.state_dict() if parallel else {n: p.detach() for n, p in model.named_parameters()}
    rp, rp64 = dict(ref.named_parameters()), dict(ref64.named_parameters())
    mine, want, want64 = _moments(model, opt, parallel), _moments(ref, ref_opt, False), _moments(ref64, ref64_opt, False)
    checks = []
    for n in rp:
        checks.append(check_tensor(f"resumed {where}: param {n} after step {step}", params.get(n), rp[n].detach(),
                                   rp64[n].detach(), factor=STATE_FACTOR))
        for k in ("exp_avg", "exp_avg_sq", "step"):
            checks.append(check_tensor(f"resumed {where}: optimizer {k} of {n} after step {step}",
                                       mine.get(n, {}).get(k), want[n][k], want64[n][k].to(want[n][k].dtype)
                                       if k == "step" else want64[n][k], factor=STATE_FACTOR))
    return checks
