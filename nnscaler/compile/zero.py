"""The data-parallel ranks of a plan for ZeRO (``ComputeConfig(zero=...)``): which mesh axis is data
parallel, the check that a plan has one (or replicas), and each rank's zero group."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ComputeConfig, PlanError
from ..dimops.partition import axis_groups
from ..runtime.mesh import GroupCache
from ..runtime.schedules import canonical_schedule


@dataclass(frozen=True)
class ZeroSpec:
    """What a :class:`~nnscaler.runtime.module.ParallelModule` needs for ZeRO: the stage, the plan's
    data-parallel mesh axis (``None``: none), this rank's zero group and its global ranks (every rank
    holding the same piece of every parameter)."""

    stage: int
    dp_axis: int | None
    group: object
    ranks: tuple[int, ...]
    unscattered: frozenset[str] = frozenset()  # parameters summed after backward elsewhere (tied across stages)


def dp_axis(plan) -> int | None:
    """The plan's data-parallel mesh axis (named ``dp``, more than one rank), or ``None``; failing
    that, a context-parallel axis (``cp``): it too holds every parameter whole and sums their gradients."""
    for want in ("dp", "cp"):
        for axis, (name, size) in enumerate(zip(plan.axis_names, plan.mesh_shape)):
            if name == want and size > 1:
                return axis
    return None


def check_zero(plan, config: ComputeConfig, policy_name: str) -> None:
    """``zero > 0`` needs ranks holding the same pieces: a ``dp`` mesh axis or replicas. Raises
    :class:`PlanError` (before any process group is made)."""
    if config.zero and dp_axis(plan) is None and config.replicas == 1:
        raise PlanError(f"zero={config.zero} needs a data-parallel axis, but the {policy_name} plan on mesh "
                        f"{plan.mesh_shape} has none; use policy dp or hybrid, or replicas (runtime_ngpus > plan_ngpus)")


def check_pipeline_zero(plans, config: ComputeConfig, policy_name: str) -> None:
    """Pipelines take ZeRO over each stage's data-parallel ranks (its plan's ``dp`` axis and the
    replicas); zero 3 not under the zero-bubble schedules (they compute weight gradients apart, from
    the parameters' own autograd nodes, which zero 3's gathered parameters do not have). Raises
    :class:`PlanError` before any process group is made."""
    if not config.zero:
        return
    if config.zero >= 3 and "ZeroBubble" in (canonical_schedule(config.schedule) or ""):
        raise PlanError(f"zero={config.zero} with the {config.schedule} schedule is not available; use zero=2, or "
                        f"schedule 1F1B, GPipe or Interleaved1F1B")
    for plan in plans:
        check_zero(plan, config, f"{policy_name} stage")


def zero_ranks(plan, config: ComputeConfig, plan_rank: int, offset: int = 0) -> tuple[int, ...]:
    """Global ranks holding plan rank ``plan_rank``'s pieces: its ``dp`` axis group, in every replica
    (``offset``: where the plan's ranks begin within a replica, a pipeline stage's)."""
    axis = dp_axis(plan)
    along = (plan_rank,) if axis is None else next(g for g in axis_groups(plan.mesh_shape)[axis] if plan_rank in g)
    return tuple(sorted(r * config.plan_ngpus + offset + q for r in range(config.replicas) for q in along))


def _group(ranks, cache: GroupCache, create: bool):
    try:
        return cache.get(list(ranks))
    except KeyError:
        if not create:
            raise
        return cache.add(ranks)


def zero_spec(plan, config: ComputeConfig, rank: int, cache: GroupCache, create: bool) -> ZeroSpec:
    """This rank's :class:`ZeroSpec`; with ``zero > 0`` every zero group is looked up in ``cache`` or,
    when ``create`` (no groups made beforehand), made by every rank in the same order."""
    plan_rank = rank % config.plan_ngpus
    mine, group = zero_ranks(plan, config, plan_rank), None
    if config.zero:
        for q in range(config.plan_ngpus):
            ranks = zero_ranks(plan, config, q)
            if len(ranks) > 1:
                g = _group(ranks, cache, create)
                group = g if ranks == mine else group
    return ZeroSpec(config.zero, dp_axis(plan), group, mine)


def stage_zero_specs(plans, config: ComputeConfig, rank: int, pp: int, k: int, cache: GroupCache, create: bool,
                     tied: frozenset[str]) -> dict[int, ZeroSpec]:
    """A pipeline's :class:`ZeroSpec` of each stage this rank runs (stage ``s`` on pipeline rank
    ``s % pp``, plan ranks ``(s % pp) * k ..``); every rank makes every stage's groups in the same order.
    ``tied``: parameters whose gradients are summed across stages after backward (not reduce-scattered)."""
    plan_rank = rank % config.plan_ngpus
    out = {}
    for s, plan in enumerate(plans):
        offset = (s % pp) * k
        for q in range(k):
            ranks = zero_ranks(plan, config, q, offset)
            g = _group(ranks, cache, create) if config.zero and len(ranks) > 1 else None
            if offset + q == plan_rank:
                out[s] = ZeroSpec(config.zero, dp_axis(plan), g, ranks, tied)
    return out
