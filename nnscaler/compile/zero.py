"""The data-parallel ranks of a plan for ZeRO (``ComputeConfig(zero=...)``): which mesh axis is data
parallel, the check that a plan has one (or replicas), and each rank's zero group."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ComputeConfig, PlanError
from ..dimops.partition import axis_groups
from ..runtime.mesh import GroupCache


@dataclass(frozen=True)
class ZeroSpec:
    """What a :class:`~nnscaler.runtime.module.ParallelModule` needs for ZeRO: the stage, the plan's
    data-parallel mesh axis (``None``: none), this rank's zero group and its global ranks (every rank
    holding the same piece of every parameter)."""

    stage: int
    dp_axis: int | None
    group: object
    ranks: tuple[int, ...]


def dp_axis(plan) -> int | None:
    """The plan's data-parallel mesh axis (named ``dp``, more than one rank), or ``None``."""
    for axis, (name, size) in enumerate(zip(plan.axis_names, plan.mesh_shape)):
        if name == "dp" and size > 1:
            return axis
    return None


def check_zero(plan, config: ComputeConfig, policy_name: str) -> None:
    """``zero > 0`` needs ranks holding the same pieces: a ``dp`` mesh axis or replicas. Raises
    :class:`PlanError` (before any process group is made)."""
    if config.zero and dp_axis(plan) is None and config.replicas == 1:
        raise PlanError(f"zero={config.zero} needs a data-parallel axis, but the {policy_name} plan on mesh "
                        f"{plan.mesh_shape} has none; use policy dp or hybrid, or replicas (runtime_ngpus > plan_ngpus)")


def zero_ranks(plan, config: ComputeConfig, plan_rank: int) -> tuple[int, ...]:
    """Global ranks holding plan rank ``plan_rank``'s pieces: its ``dp`` axis group, in every replica."""
    axis = dp_axis(plan)
    along = (plan_rank,) if axis is None else next(g for g in axis_groups(plan.mesh_shape)[axis] if plan_rank in g)
    return tuple(sorted(r * config.plan_ngpus + q for r in range(config.replicas) for q in along))


def zero_spec(plan, config: ComputeConfig, rank: int, cache: GroupCache, create: bool) -> ZeroSpec:
    """This rank's :class:`ZeroSpec`; with ``zero > 0`` every zero group is looked up in ``cache`` or,
    when ``create`` (no groups made beforehand), made by every rank in the same order."""
    plan_rank = rank % config.plan_ngpus
    mine, group = zero_ranks(plan, config, plan_rank), None
    if config.zero:
        for q in range(config.plan_ngpus):
            ranks = zero_ranks(plan, config, q)
            if len(ranks) == 1:
                continue
            try:
                g = cache.get(list(ranks))
            except KeyError:
                if not create:
                    raise
                g = cache.add(ranks)
            group = g if ranks == mine else group
    return ZeroSpec(config.zero, dp_axis(plan), group, mine)
