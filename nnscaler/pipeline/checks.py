"""Bad pipeline input, refused with one clear line before any rank starts work."""
from __future__ import annotations

import difflib
from typing import Any, Mapping, Sequence

import torch

from ..policies.plan import PlanError
from ..runtime.microbatch import MicroBatchError, check_divisible
from .schedules import SCHEDULES, canonical_schedule, stages_per_rank


def check_config(config) -> None:
    """``pp_size`` divides ``plan_ngpus``; the schedule exists; ``pp_split`` names one module per stage
    boundary. Raises :class:`PlanError`."""
    pp = config.pp_size
    if not isinstance(pp, int) or pp < 1:
        raise PlanError(f"pp_size must be a positive integer, got {pp!r}")
    if config.plan_ngpus % pp:
        raise PlanError(f"pp_size {pp} does not divide the world size {config.plan_ngpus} (plan_ngpus); "
                        f"choose a divisor such as {', '.join(str(d) for d in range(1, config.plan_ngpus + 1) if config.plan_ngpus % d == 0)}")
    if canonical_schedule(config.schedule) is None:
        raise PlanError(f"unknown pipeline schedule {config.schedule!r}; valid: {', '.join(SCHEDULES)}")
    if config.pp_split is not None:
        split = config.pp_split
        if isinstance(split, str) or not all(isinstance(s, str) for s in split):
            raise PlanError(f"pp_split must be a tuple of module names (e.g. ('transformer.h.1',)), got {split!r}")
        want = pp * stages_per_rank(config.schedule) - 1
        if len(split) != want:
            raise PlanError(f"pp_split names {len(split)} modules but {pp * stages_per_rank(config.schedule)} stages "
                            f"need {want} split points")


def n_stages(config) -> int:
    """Pipeline stages in all (``pp_size`` times the stages per rank of the schedule)."""
    return config.pp_size * stages_per_rank(config.schedule)


def cut_units(model: torch.nn.Module) -> list[str]:
    """Modules owning parameters directly (each tied tensor counted once), in definition order: the
    finest units a stage cut may fall between (the "layers" a pipeline can count on)."""
    seen, out = set(), []
    for name, mod in model.named_modules():
        own = [p for p in mod.parameters(recurse=False) if id(p) not in seen]
        if own:
            seen.update(id(p) for p in own)
            out.append(name)
    return out


def run_order(model: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None,
              names: Sequence[str]) -> dict[str, int]:
    """The order in which the named modules first run in one forward of ``model`` on the sample (no
    gradients; the random state and every buffer, a batch norm's running statistics, left as they were).
    A module that never runs is absent."""
    order: dict[str, int] = {}

    def seen(name: str):
        def hook(module, inputs) -> None:  # returns None: the inputs pass unchanged
            order.setdefault(name, len(order))
        return hook
    hooks = [model.get_submodule(n).register_forward_pre_hook(seen(n)) for n in names]
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(*args, **(kwargs or {}))
    except Exception as exc:  # the sample does not fit the model: say so in one line, not a deep traceback
        raise PlanError(f"{type(model).__name__} fails on the sample arguments ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}); pass a batch the model accepts") from None
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(buffers[k])
    return order


def check_split_order(model: torch.nn.Module, split: tuple[str, ...], args: Sequence[Any] = (),
                      kwargs: Mapping[str, Any] | None = None) -> None:
    """Split points name distinct, disjoint modules in the order the model runs them (found by one
    forward on the sample, :func:`run_order`; the traced program confirms it,
    :func:`~nnscaler.pipeline.cut.split_at_modules`). Raises :class:`PlanError`."""
    for a, b in zip(split, split[1:]):
        if a == b or b.startswith(a + ".") or a.startswith(b + "."):
            raise PlanError(f"split points {a!r} and {b!r} {'are the same module' if a == b else 'nest'}; name one "
                            f"module per stage boundary, each after the previous one")
    if len(split) < 2:
        return
    order = run_order(model, args, kwargs, split)
    idle = [n for n in split if n not in order]
    if idle:
        raise PlanError(f"split point {idle[0]!r} never runs in {type(model).__name__}'s forward on the sample; "
                        f"name modules the model runs")
    for a, b in zip(split, split[1:]):
        if order[b] < order[a]:
            raise PlanError(f"split points {list(split)} are not in program order ({b!r} runs before {a!r} in "
                            f"{type(model).__name__}); name them in the order the model runs them")


def check_model(model: torch.nn.Module, args: Sequence[Any], config, kwargs: Mapping[str, Any] | None = None) -> None:
    """The model-dependent pipeline checks: enough layers for the stages, split points that exist
    and hold parameters, a batch divisible into micro-batches. Raises :class:`PlanError`."""
    stages = n_stages(config)
    units = cut_units(model)
    if stages > len(units):
        raise PlanError(f"{stages} pipeline stages but {type(model).__name__} has only {len(units)} layers "
                        f"(modules with parameters) to cut between; use pp_size <= {len(units) // (stages // config.pp_size)}")
    modules = dict(model.named_modules())
    for name in config.pp_split or ():
        if name not in modules:
            close = difflib.get_close_matches(name, list(modules), n=3)
            raise PlanError(f"split point {name!r} is not a module of {type(model).__name__}"
                            + (f"; did you mean {', '.join(close)}?" if close else ""))
        if not any(True for _ in modules[name].parameters()):
            raise PlanError(f"split point {name!r} holds no parameters; name a module with parameters")
    try:
        check_divisible(args, kwargs, config.num_microbatches)
    except MicroBatchError as exc:
        raise PlanError(f"sample_args: {exc}") from None
    check_split_order(model, tuple(config.pp_split or ()), args, kwargs)
