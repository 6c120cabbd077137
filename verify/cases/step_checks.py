"""What each training step of a whole-model case is judged by (``verify/cases/training.py``): the
point the step starts from installed bit for bit, then every gradient against one device and every
parameter after the parallel optimizer's step against AdamW on one device (``verify/judge/compare.py``);
and the model's own state without aliases, which the point and the checkpoint are made of."""
from __future__ import annotations

import torch

from typing import Callable

from verify.cases.buffers import buffer_checks
from verify.judge.compare import Check, check_tensor, check_update

LR = 1e-2


def own_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` without aliases: a tied tensor goes by its first name only (as
    ``named_parameters()`` and the compiled module name it)."""
    seen, out = set(), {}
    for k, v in model.state_dict(keep_vars=True).items():
        if id(v) not in seen:
            seen.add(id(v))
            out[k] = v.detach()
    return out


def with_aliases(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (first names only) completed with every alias ``model.state_dict()`` lists."""
    first: dict[int, str] = {}
    for k, v in model.state_dict(keep_vars=True).items():
        first.setdefault(id(v), k)
    return {k: state[first[id(v)]] for k, v in model.state_dict(keep_vars=True).items() if first[id(v)] in state}


def clone_state(state: dict) -> dict:
    """A copy of every tensor of ``state``."""
    return {k: v.clone() for k, v in state.items()}


def equal_check(name: str, par, want) -> Check:
    """``par`` (the parallel module's tensor, or ``None``) equals ``want`` bit for bit."""
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
    checks = [equal_check(n, state.get(n), want) for n, want in point.items() if n in state]
    bad = [c for c in checks if not c.ok]
    return Check(f"load step {step}", max((c.err for c in bad), default=0.0), 0.0, not bad,
                 f"{bad[0].name}: {bad[0].reason}" if bad else "")


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
    with torch.no_grad():  # the shadow may be a model's own parameters (a resumed one)
        for n, t in shadow.items():
            t.copy_(point[n])
            t.grad = None if grads.get(n) is None else grads[n].to(t.dtype).clone()
    for opt in opts:
        opt.step()
        opt.zero_grad()
    after = pm.state_dict()
    checks += [check_update(f"param {n} after step {step}", after.get(n), t, LR, widen) for n, t in shadow.items()]
    return checks + (buffer_checks(pm, after, buffers, step, kw) if buffers is not None else [])
