"""What one device does for each step-like recipe field: the single-device reference of
:mod:`nnscaler.runtime.grad_steps` (what ``train_step`` does to the gradients after backward, before the
optimizer step), one registered :class:`ReferenceStep` per field (``@reference_step("clip_grad_norm")``:
torch's own ``clip_grad_norm_``), and what it measures that the program must agree with (the total norm,
checked each step as ``grad norm step S`` against ``pm.last_grad_norm``). The training loop
(``verify/cases/training.py``), its one-device strategies, the expected check names and the kink
explanation (``verify/cases/kinks.py``) consult :func:`active` for every field off its default; a new
step-like field's reference is one function here."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from nnscaler.recipe import Recipe

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Recipe)}


@dataclass(frozen=True)
class ReferenceStep:
    """Field ``name``'s reference: ``apply(value, params)`` on the single-device gradients (returning what it
    measured, or None); ``measured``: the check's name of that measure (``{}``: the step) and ``parallel(pm)``
    what the program measured alike."""

    name: str
    apply: Callable[[Any, list[torch.nn.Parameter]], torch.Tensor | None]
    measured: str | None = None
    parallel: Callable[[Any], torch.Tensor | None] | None = None


REFERENCE_STEPS: dict[str, ReferenceStep] = {}


def reference_step(name: str, measured: str | None = None, parallel: Callable | None = None) -> Callable:
    """Register the decorated ``apply(value, params)`` as recipe field ``name``'s single-device reference."""
    if name not in _DEFAULTS:
        raise ValueError(f"reference_step({name!r}): Recipe has no field {name!r}")

    def register(apply):
        REFERENCE_STEPS[name] = ReferenceStep(name, apply, measured, parallel)
        return apply
    return register


def active(recipe: Recipe) -> list[tuple[ReferenceStep, Any]]:
    """The registered steps whose field ``recipe`` sets off its default, with the value, in order."""
    out = []
    for name, step in REFERENCE_STEPS.items():
        value = getattr(recipe, name)
        if value is not None and value != _DEFAULTS[name]:
            out.append((step, value))
    return out


def apply_steps(recipe: Recipe, params) -> dict[str, torch.Tensor]:
    """Every active step on ``params``' gradients, in order; what each measured, by field."""
    params = list(params)
    out = {}
    for step, value in active(recipe):
        got = step.apply(value, params)
        if step.measured is not None:
            out[step.name] = got.detach()
    return out


def measured_names(recipe: Recipe, step: int) -> list[str]:
    """The names of the checks of what the active steps measure at ``step`` (``grad norm step 0``)."""
    return [s.measured.format(step) for s, _ in active(recipe) if s.measured is not None]


@reference_step("clip_grad_norm", measured="grad norm step {}", parallel=lambda pm: pm.last_grad_norm)
def clip_reference(max_norm: float, params: list[torch.nn.Parameter]) -> torch.Tensor:
    """torch's own clipping of the whole model; the total norm it found."""
    return torch.nn.utils.clip_grad_norm_(params, max_norm)
