"""The training steps of a user's parallel program against one device, shared by a module
(:mod:`verify.cases.torchpar.case`) and a pipeline's stages (:mod:`verify.cases.torchpar.pipeline`): each step
loads the same whole parameters into both, runs the program's step and the one-device reference (float64
beside it), and checks the load, the loss, every gradient and AdamW's update."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from verify.cases.batch import cast
from verify.cases.kinks import KinkSides, explainer
from verify.cases.reference import SharedReference, reference_grads
from verify.cases.resume import exact
from verify.cases.step_checks import LR, step_checks
from verify.judge.compare import Check, Float64Fallback, check_tensor
from verify.judge.dtypes import convert_state
from verify.judge.finite import require_finite


class ReferenceSteps:
    """One device's side of the training loop: the reference ``ref`` in the run's dtype ``dt`` and ``ref64``
    in float64, the ``shadow`` parameters AdamW steps with the program's gradients, and the optimizers ``opts``
    (the program's own first). :meth:`fresh` starts a run; a resumed model is its own shadow."""

    def __init__(self, ref: torch.nn.Module, ref64: torch.nn.Module, dt: torch.dtype, opts: list, shadow: dict):
        self.ref, self.ref64 = ref, ref64
        self.params = dict(ref.named_parameters())
        self.shadow, self.opts = shadow, opts
        self.fallback = Float64Fallback(dt)

    @classmethod
    def fresh(cls, ref: torch.nn.Module, ref64: torch.nn.Module, own_params, dt: torch.dtype) -> "ReferenceSteps":
        """A run from the start: the shadow a copy of ``ref``'s parameters, AdamW over the program's
        ``own_params``, over ``ref``'s own and over the shadow."""
        shadow = {n: p.detach().clone() for n, p in ref.named_parameters()}
        opts = [torch.optim.AdamW(own_params, lr=LR)]
        opts += [torch.optim.AdamW(ps, lr=LR) for ps in (ref.parameters(), shadow.values())]
        return cls(ref, ref64, dt, opts, shadow)

    def step(self, step: int, args, held, load: Callable[[dict], None] | None, run: Callable[[], torch.Tensor]
             ) -> list[Check]:
        """The checks of step ``step`` on the batch ``args``: the reference's parameters loaded into the
        program (``load``; ``held.state_dict()`` gives them back whole; ``None`` where the program holds them
        already, as after a resume), the program's loss (``run()``) and gradients and update (``held``, as
        :func:`verify.cases.step_checks.step_checks` reads them)."""
        point = {n: p.detach().clone() for n, p in self.params.items()}
        checks = []
        if load is not None:
            load(point)
            loaded = held.state_dict()
            bad = [c for c in (exact(n, loaded.get(n), t) for n, t in point.items()) if not c.ok]
            checks.append(Check(f"load step {step}", 0.0 if not bad else float("inf"), 0.0, not bad,
                                f"{bad[0].name}: {bad[0].reason}" if bad else ""))
        self.ref64.load_state_dict(convert_state(point, torch.float64), strict=False)
        loss = run()
        fallback = self.fallback
        sides = KinkSides(fallback)  # float64 takes the run's side of a kink where within rounding
        with sides.record():
            loss_ref = self.ref(*args)
        loss_ref.backward()
        with fallback, sides.follow():
            loss64 = self.ref64(*cast(args, torch.float64))
            loss64.backward()
        kw = fallback.bounds()
        grads, grads64 = reference_grads(self.params, self.ref64)
        require_finite({"loss": loss_ref, "loss64": loss64, "grads": grads, "grads64": grads64}, step)
        checks.append(check_tensor(f"loss step {step}", loss, loss_ref.detach(), loss64.detach(), **kw))
        kinks = explainer(step, SharedReference(), lambda: (self.ref, self.ref64), lambda m, a: m(*a), args,  # each
                          fallback, contextlib.nullcontext)  # rank's own reference
        return checks + step_checks(held, grads, grads64, self.shadow, point, self.opts, step, fallback.widen, kw,
                                    kinks)

