"""What localisation says where no tensor of the program diverges on step 0, true to the failing check:
the model itself (run eagerly on one device) against the graph the compiler traced from it, and the
buffers the model writes in forward that the compiled program does not write back.

Localisation compares the program with its *traced graph* run on one device; a trace that is not the
model (an in-place buffer update, a ``torch.no_grad`` region lost in it) leaves every tensor of the
program matching that graph while the case's checks, which judge the model itself, fail on step 0. A
sentence saying "every tensor matches" next to a failing step-0 gradient would then contradict the
check; this module says instead where the two part ways."""
from __future__ import annotations

import re

import torch

from verify.cases.draws import same_draws

NOT_THE_MODEL = "but that graph is not the model"  # the note's words where the trace differs from the model
STEP_ZERO = re.compile(r"^(loss|grad norm|grad .+) step 0$")  # the case's own step-0 forward and backward
BUFFER_CHECK = re.compile(r"^buffer (.+) after step \d+$")  # a buffer compared after a step (verify/cases/buffers.py)


def step_zero_check(check: str) -> bool:
    """Whether ``check`` (a failing check's name) judges the case's own forward or backward of step 0."""
    return bool(STEP_ZERO.match(check))


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _changed(before: dict, after: dict) -> list[str]:
    return [n for n, b in before.items() if n in after and (b.shape != after[n].shape or not torch.equal(b, after[n]))]


def eager_step(model: torch.nn.Module, args: tuple) -> tuple[torch.Tensor, dict, list[str]]:
    """``model``'s loss on ``args`` run eagerly (from the localiser's generator state), every
    parameter's gradient by name, and the names of the buffers its forward wrote."""
    before = _buffers(model)
    with same_draws(0, 0):
        loss = model(*args)
    written = _changed(before, _buffers(model))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, written


def program_writes(pm, args: tuple, names: list[str]) -> list[str]:
    """Which of the buffers ``names`` the compiled module ``pm`` writes in one forward on ``args``
    (every rank of its plan calls this: the forward runs its collectives)."""
    before = {n: t.detach().clone() for n, t in pm.whole_state().items() if n in names}  # non-persistent too
    with torch.no_grad(), same_draws(0, 0):
        pm(*args)
    return _changed(before, {n: t.detach() for n, t in pm.whole_state().items() if n in names})


def graph_differs(loss, grads: dict, graph_loss, graph_grads: dict, dtype: torch.dtype) -> tuple[str, float] | None:
    """The first of the loss and the gradients where the model run eagerly (``loss``, ``grads``) and its
    traced graph on one device (``graph_loss``, ``graph_grads``) differ beyond rounding (64 ulps of
    ``dtype`` of the largest value), as (what, error); ``None`` where they agree."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    pairs = [("loss", loss, graph_loss)] + [(f"the gradient of {n}", g, graph_grads.get(n)) for n, g in grads.items()]
    scale = max((float(g.detach().abs().max()) for g in grads.values() if g is not None and g.numel()), default=0.0)
    for what, a, b in pairs:
        if (a is None) != (b is None):
            return what, float("inf")
        if a is None or a.shape != b.shape:
            continue
        err = float((a.double() - b.detach().double()).abs().max()) if a.numel() else 0.0
        bound = 64 * eps * max(scale if what != "loss" else 0.0, float(a.double().abs().max()) if a.numel() else 0.0)
        if not err <= bound:
            return what, err
    return None


def unlocalised(failing: str, differs: tuple[str, float] | None, unwritten: list[str], otherwise: str) -> str:
    """The row's note where no tensor of the program diverges on step 0: ``failing`` is the first
    failing check, ``differs`` where the model itself and its traced graph part ways
    (:func:`graph_differs`), ``unwritten`` the buffers the model writes in forward and the program does
    not, ``otherwise`` the note for a failure after step 0's backward."""
    buffers = ""
    if unwritten:
        many = len(unwritten) > 1
        buffers = (f"the model writes buffer{'s' if many else ''} {', '.join(unwritten[:5])} in forward (in place) and "
                   f"the compiled program does not write {'them' if many else 'it'}")
    if differs is not None:
        what, err = differs
        text = (f"every tensor of the program on step 0 matches the graph traced from the model, run on one device, "
                f"{NOT_THE_MODEL}: on one device the model itself gives {what} {err:.3g} apart "
                f"from its traced graph, so the fault lies in the trace of the model, not in the plan")
        return text + (f" ({buffers})" if buffers else "")
    buffer = BUFFER_CHECK.match(failing)
    if buffer and buffer.group(1) in unwritten:
        return f"{buffers}: every tensor of the program's step 0 matches the single-device run, the buffer is left as it was"
    if buffer:
        return (f"every tensor of the program's step 0 matches the single-device run, but the program writes buffer "
                f"{buffer.group(1)} a value one device does not: its write (the new value converted to the layout the "
                f"buffer is held in, a statistic of a split batch reduced over the ranks first) is wrong"
                + (f"; {buffers}" if buffers else ""))
    if step_zero_check(failing):
        where = ("the gradients part ways after backward, in their sync across ranks (all-reduce, ZeRO's "
                 "reduce-scatter) or clipping" if failing.startswith("grad") else
                 "the loss parts ways in what localisation does not rerun (the row's recipe: micro-batches, "
                 "precision, ZeRO, clipping)")
        text = (f"every tensor inside the program's step-0 forward and backward matches the single-device run of "
                f"the same graph, and that graph matches the model itself: {where}")
        return text + (f"; {buffers}" if buffers else "")
    return otherwise + (f"; {buffers}" if buffers else "")
