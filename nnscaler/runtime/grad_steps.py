"""What ``train_step`` does to the gradients after the last backward and before the caller's optimizer
step, one function per step-like field of the recipe (:class:`~nnscaler.recipe.Recipe`), applied in the
order registered wherever the field is off its default: ``@grad_step("clip_grad_norm")`` (the whole
model's norm clipped, :mod:`.clip`). :func:`after_backward` runs them for a :class:`~.module.ParallelModule`
or a :class:`~.pipeline.PipelineModule` (each calls it at the end of its ``train_step``; a loop that runs
its own forward and backward calls it too). A new step-like recipe field is its field, one function here
and its single-device reference (the harness's ``verify/cases/recipe_steps.py``)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ..recipe import Recipe

GRAD_STEPS: dict[str, Callable[[Any, Any], None]] = {}
"""recipe field -> ``fn(module, value)``, applied to ``module``'s local gradients (every rank of it calls)."""

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Recipe)}


def grad_step(name: str) -> Callable:
    """Register the decorated ``fn(module, value)`` as what recipe field ``name`` does after backward."""
    if name not in _DEFAULTS:
        raise ValueError(f"grad_step({name!r}): Recipe has no field {name!r}")

    def register(fn: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
        GRAD_STEPS[name] = fn
        return fn
    return register


def after_backward(module, recipe: Recipe | None = None) -> None:
    """Every registered step of ``recipe`` (default ``module.recipe``) whose field is off its default,
    in order, on ``module``'s gradients."""
    recipe = module.recipe if recipe is None else recipe
    for name, fn in GRAD_STEPS.items():
        value = getattr(recipe, name)
        if value is not None and value != _DEFAULTS[name]:
            fn(module, value)


@grad_step("clip_grad_norm")
def clip_grads(module, max_norm: float) -> None:
    """The whole model's gradient norm clipped to ``max_norm`` (``module.clip_grad_norm_``, :mod:`.clip`)."""
    module.clip_grad_norm_(max_norm)
