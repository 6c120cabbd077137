"""One rank's part of a whole-model case: compile with ``nnscaler.parallelize``, train a few AdamW
steps, and judge the loss, every parameter gradient and every parameter after each step against
single-device training (in the dtype under test, calibrated by float64 as for operators)."""
from __future__ import annotations

import copy
import warnings
from pathlib import Path

import torch

from nnscaler.parallel import parallelize
from nnscaler.policies import ComputeConfig
from nnscaler.runtime.mesh import GroupCache
from nnscaler.trace.build import UnknownOperatorWarning

from .compare import STATE_FACTOR, Check, check_tensor
from .models.loader import find_builder

LR = 1e-2


def _f64(args: tuple) -> tuple:
    return tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def run_model_case(name: str, policy: str, world_size: int, steps: int, seed: int, groups: GroupCache,
                   gen_dir: str) -> list[Check]:
    """Checks for ``steps`` training steps of model ``name`` under ``policy`` on ``world_size`` ranks."""
    case = find_builder(name)(seed)
    ref, ref64 = copy.deepcopy(case.model), copy.deepcopy(case.model).double()
    config = ComputeConfig(world_size, tp_size=2 if world_size % 2 == 0 else 1, seed=seed)
    with warnings.catch_warnings():  # replicated unknown operators are verified like the rest
        warnings.simplefilter("ignore", UnknownOperatorWarning)
        pm = parallelize(case.model, case.batch(0), policy, config, groups=groups, verify=False,
                         gen_savedir=Path(gen_dir) / f"{name}-{policy}-w{world_size}-s{seed}")
    opts = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (pm, ref, ref64)]
    checks: list[Check] = []
    for step in range(steps):
        args = case.batch(step)
        loss, loss_ref, loss64 = pm(*args), ref(*args), ref64(*_f64(args))
        for x in (loss, loss_ref, loss64):
            x.backward()
        checks.append(check_tensor(f"loss step {step}", loss.detach(), loss_ref.detach(), loss64.detach()))
        grads, rp, rp64 = pm.whole_grads(), dict(ref.named_parameters()), dict(ref64.named_parameters())
        scale = max(float(p.grad.abs().max()) for p in rp64.values() if p.grad is not None)
        for n, g in grads.items():
            checks.append(check_tensor(f"grad {n} step {step}", g, rp[n].grad, rp64[n].grad, scale=scale))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        state = pm.state_dict()
        for n in grads:
            checks.append(check_tensor(f"param {n} after step {step}", state[n], rp[n].detach(), rp64[n].detach(),
                                       factor=STATE_FACTOR))
    checks += _reload_checks(name, policy, pm.state_dict(), ref, ref64, case.batch(steps), groups, gen_dir,
                             world_size, seed)
    return checks


def _reload_checks(name, policy, state, ref, ref64, args, groups, gen_dir, world_size, seed) -> list[Check]:
    """The merged checkpoint loads into the single-device model and into a module under another plan."""
    with torch.no_grad():
        want, want64 = ref(*args), ref64(*_f64(args))
        single = find_builder(name)(seed).model
        single.load_state_dict(state, strict=False)
        other_policy = "dp" if policy != "dp" else "tp"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnknownOperatorWarning)
            other = parallelize(find_builder(name)(seed).model, args, other_policy, ComputeConfig(world_size, seed=seed + 1),
                                groups=groups, verify=False, gen_savedir=Path(gen_dir) / f"{name}-reload-w{world_size}-s{seed}")
        other.load_state_dict(state)
        return [check_tensor("loss of the checkpoint on one device", single(*args), want, want64),
                check_tensor(f"loss of the checkpoint under {other_policy}", other(*args), want, want64)]
