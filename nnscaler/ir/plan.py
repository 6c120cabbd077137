"""Plans: a partition of every operator on one rank mesh, and the checks every plan must pass (data
only: a plan's cost and how it prints live in :mod:`nnscaler.cost`, reached through ``plan.stats``).

A policy is a plain function ``(graph, config) -> Plan``. Each operator's partition has one entry per
mesh axis: the identifier it splits along that axis, or ``None`` to replicate along it. Operators
the registry does not know are replicated on every axis.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Protocol

from ..config import ComputeConfig, PlanError
from ..dimops.grammar import AnnotationError
from ..dimops.partition import Partition, check_partition
from .graph import IRGraph, IROp


class PlanCost(Protocol):
    """What a plan's cost estimate answers (:class:`nnscaler.cost.estimate.PlanStats`, attached by
    ``plan_model`` / ``parallelize``): the plan as a dict, as tables, in one line."""

    def summary(self, plan: "Plan") -> dict: ...

    def report(self, plan: "Plan") -> str: ...

    def one_line(self, plan: "Plan") -> str: ...


@dataclass
class Plan:
    """Partitions of every known operator on a mesh of ``mesh_shape`` (product = plan ranks)."""

    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    partitions: dict[str, Partition] = field(default_factory=dict)
    policy: str = ""
    stats: PlanCost | None = field(default=None, repr=False, compare=False)  # set by plan_model / parallelize
    note: str = field(default="", compare=False)  # what the policy wants the user to know (autodist's search)
    # state tensor name -> the layout it is held in (``("D0", "R")``, as a program's STATE writes it), where not
    # where its first reader wants it: a program respecialised for another branch holds its predecessor's pieces
    held: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # operator name -> the batch's identifier, for operators run on every data-parallel replica's rows (of
    # ``replicas``): they mix the rows on the way to a buffer forward writes (:mod:`nnscaler.compile.writes`)
    over_replicas: dict[str, str] = field(default_factory=dict)
    replicas: int = 1

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    def partition(self, op: IROp) -> Partition:
        """The op's partition (replicated everywhere when the op is unknown)."""
        if op.name in self.partitions:
            return self.partitions[op.name]
        return replicated(self.mesh_shape)

    def describe(self) -> str:
        return ", ".join([f"{name}: {p.label}" for name, p in self.partitions.items()]
                         + [f"held {name}: {'/'.join(lay)}" for name, lay in sorted(self.held.items())]
                         + [f"{name}: over {self.replicas} replicas' rows of {i}" for name, i in self.over_replicas.items()])

    def _stats(self) -> PlanCost:
        if self.stats is None:
            raise PlanError("this plan has no cost estimate yet: make it with nnscaler.plan_model (or parallelize)")
        return self.stats

    def summary(self) -> dict:
        """Per-rank memory, sharded tensors, collectives per step, estimated step time (a dict)."""
        return self._stats().summary(self)

    def report(self) -> str:
        """:meth:`summary` as readable tables."""
        return self._stats().report(self)

    def one_line(self) -> str:
        """The summary in one line, as ``parallelize`` prints it."""
        return self._stats().one_line(self)


def replicated(mesh_shape: tuple[int, ...]) -> Partition:
    return Partition(tuple((None, f) for f in mesh_shape), math.prod(mesh_shape))


def validate(plan: Plan, graph: IRGraph, config: ComputeConfig) -> None:
    """Raise :class:`PlanError` unless ``plan`` gives every known op a valid partition on its mesh."""
    if plan.world_size != config.plan_ngpus:
        raise PlanError(f"plan mesh {plan.mesh_shape} has {plan.world_size} ranks; the config asks for "
                        f"plan_ngpus={config.plan_ngpus}")
    for op in graph.ops:
        if not op.known:
            continue
        p = plan.partitions.get(op.name)
        if p is None:
            raise PlanError(f"the {plan.policy or 'given'} policy left operator {op.name} ({op.overload}) without ranks")
        if tuple(f for _, f in p.splits) != plan.mesh_shape:
            raise PlanError(f"operator {op.name}: partition {p.label} does not lie on the mesh {plan.mesh_shape}")
        try:
            check_partition(op.bound, p)
        except AnnotationError as exc:
            raise PlanError(f"operator {op.name} ({op.spec.annotation}): {exc}") from None


Policy = Callable[[IRGraph, ComputeConfig], Plan]
"""A policy: a :class:`Plan` naming the operators of the graph it is given. It may rewrite that graph in place
(the ring policies rebind each attention to one operator, :mod:`nnscaler.policies.ring`; every other built-in
policy only reads it): its plan names the rewritten operators, so the caller compiles the graph it handed in,
which is its own (a fresh trace, or :meth:`~nnscaler.ir.graph.IRGraph.copy` of a cached one), as
``apply_precision`` also writes into it. A caller planning one graph under several policies gives each a copy."""
