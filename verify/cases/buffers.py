"""Every buffer of the model compared after every step, not only its parameters: a buffer its
forward writes in place (an EMA of activations, running statistics, a step counter) must hold on the
parallel module what it holds on one device after the same step (``buffer NAME after step S``). A
buffer the parallel module does not hold passes only where the model's forward left it as it was.
Non-persistent buffers (out of ``state_dict``) are gathered only in a step whose forward wrote one on
one device (one more whole-state gather per step otherwise, for RoPE tables nobody writes); a program
that writes one the model does not is seen by the next step's loss, since loads leave them as they are."""
from __future__ import annotations

import torch

from verify.judge.compare import Check, check_tensor


def buffer_names(model: torch.nn.Module) -> list[str]:
    """Every buffer of ``model`` by its first name (a shared one once), non-persistent ones too."""
    seen, out = set(), []
    for n, b in model.named_buffers():
        if id(b) not in seen:
            seen.add(id(b))
            out.append(n)
    return out


def held(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every buffer of ``model`` by first name (taken before its step's forward)."""
    named = dict(model.named_buffers())
    return {n: named[n].detach().clone() for n in buffer_names(model)}


def reference_buffers(ref: torch.nn.Module, ref64: torch.nn.Module, before: dict) -> dict:
    """What the single-device step left in the buffers: ``buffers`` (the recipe's run), ``buffers64``
    (float64) and ``written``, the names its forward changed (from ``before``, :func:`held`)."""
    after = held(ref)
    written = [n for n, b in before.items() if n in after and not torch.equal(b, after[n])]
    return {"buffers": after, "buffers64": held(ref64), "written": written}


def buffer_checks(pm, state: dict, one: dict, step: int, kw: dict) -> list[Check]:
    """``buffer NAME after step S`` for every buffer of the single-device run (``one``, from
    :func:`reference_buffers`) against the parallel module's whole tensors: ``state`` (its
    ``state_dict`` after the step) and, where one device wrote a name it lacks, ``whole_state``
    (non-persistent buffers; every rank calls it alike: ``one`` is shared)."""
    want = one["buffers"]
    missing = {n for n in want if n not in state}
    if missing & set(one["written"]):
        state = {**pm.whole_state(), **state}
    checks = []
    for n, dev in want.items():
        name = f"buffer {n} after step {step}"
        par = state.get(n)
        if par is None and n in missing and n not in one["written"]:
            checks.append(Check(name, 0.0, 0.0, True, ""))  # not persistent, not written on one device
            continue
        if par is None:
            ok = n not in one["written"]
            checks.append(Check(name, 0.0 if ok else float("inf"), 0.0, ok, "" if ok else
                                "the parallel module does not hold it, and the model's forward wrote it"))
            continue
        checks.append(check_tensor(name, par.detach(), dev, one["buffers64"].get(n, dev), **kw))
    return checks
