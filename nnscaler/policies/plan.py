"""Plans: a partition of every operator on one rank mesh, and the checks every plan must pass.

A policy is a plain function ``(graph, config) -> Plan``. Each operator's partition has one entry per
mesh axis: the identifier it splits along that axis, or ``None`` to replicate along it. Operators
the registry does not know are replicated on every axis.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ..dimops.grammar import AnnotationError
from ..dimops.partition import Partition, check_partition
from ..ir.graph import IRGraph, IROp

if TYPE_CHECKING:
    from ..cost.estimate import PlanStats


class PlanError(ValueError):
    """A plan that cannot run: wrong mesh, an operator without a partition, an invalid split."""


@dataclass(frozen=True)
class ComputeConfig:
    """How many ranks one copy of the plan uses (``plan_ngpus``) and how many run in all
    (``runtime_ngpus``, a multiple: the extra copies are data-parallel replicas). ``tp_size`` is
    the tensor-parallel degree of the ``hybrid`` policy; ``seed`` feeds the ``random`` policy;
    ``bucket_bytes`` sets the size of gradient-sync buckets. ``mem_budget`` (bytes per rank) bounds
    ``autodist``'s plans; ``profile`` names the device the cost model assumes (``cpu-gloo``,
    ``a100``, ``h100``; default ``cpu-gloo``). ``sequence_parallel``: under ``tp``/``hybrid``, norms,
    dropout and residual adds between the tensor-parallel regions are split along the sequence
    (Megatron-LM's sequence parallelism: each all-reduce becomes a reduce-scatter and an all-gather).
    ``num_microbatches``: ``ParallelModule.train_step`` splits each batch into this many micro-batches
    along dim 0 and accumulates their gradients (one gradient sync, after the last); ``parallelize``
    then takes a sample of the whole batch and compiles for one micro-batch.

    ``pp_size``/``schedule``/``pp_split``: pipeline stages (see :mod:`nnscaler.pipeline`)."""

    plan_ngpus: int
    runtime_ngpus: int | None = None
    tp_size: int | None = None
    seed: int = 0
    bucket_bytes: int | None = None  # gradient-sync bucket size (None: nnscaler.runtime.grad_sync.BUCKET_BYTES)
    mem_budget: int | None = None
    profile: str | None = None
    sequence_parallel: bool = False
    num_microbatches: int = 1
    # pipeline parallelism (``nnscaler.pipeline``): ``pp_size`` stages of ``plan_ngpus // pp_size`` ranks each,
    # run by ``schedule``; ``pp_split`` names the modules where stages 1.. begin (default: balance the cost model)
    pp_size: int = 1
    schedule: str = "1F1B"
    pp_split: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.plan_ngpus < 1:
            raise PlanError(f"plan_ngpus must be at least 1, got {self.plan_ngpus}")
        if self.runtime_ngpus is not None and (self.runtime_ngpus < self.plan_ngpus or self.runtime_ngpus % self.plan_ngpus):
            raise PlanError(f"runtime_ngpus ({self.runtime_ngpus}) must be a multiple of plan_ngpus ({self.plan_ngpus})")
        if isinstance(self.num_microbatches, bool) or not isinstance(self.num_microbatches, int) \
                or self.num_microbatches < 1:
            raise PlanError(f"num_microbatches must be a positive integer, got {self.num_microbatches!r}")
        if self.bucket_bytes is not None and self.bucket_bytes < 1:
            raise PlanError(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        if self.mem_budget is not None and self.mem_budget <= 0:
            raise PlanError(f"mem_budget must be a positive number of bytes per rank, got {self.mem_budget}")
        if self.pp_size != 1 or self.pp_split is not None or self.schedule != "1F1B":
            from ..pipeline.checks import check_config
            check_config(self)
        if self.profile is not None:
            from ..cost.profiles import ProfileError, get_profile
            try:
                get_profile(self.profile)
            except ProfileError as exc:
                raise PlanError(str(exc)) from None

    @property
    def replicas(self) -> int:
        return (self.runtime_ngpus or self.plan_ngpus) // self.plan_ngpus


@dataclass
class Plan:
    """Partitions of every known operator on a mesh of ``mesh_shape`` (product = plan ranks)."""

    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    partitions: dict[str, Partition] = field(default_factory=dict)
    policy: str = ""
    stats: "PlanStats | None" = field(default=None, repr=False, compare=False)  # set by plan_model / parallelize
    note: str = field(default="", compare=False)  # what the policy wants the user to know (autodist's search)

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    def partition(self, op: IROp) -> Partition:
        """The op's partition (replicated everywhere when the op is unknown)."""
        if op.name in self.partitions:
            return self.partitions[op.name]
        return replicated(self.mesh_shape)

    def describe(self) -> str:
        return ", ".join(f"{name}: {p.label}" for name, p in self.partitions.items())

    def summary(self) -> dict:
        """Per-rank memory, sharded tensors, collectives per step, estimated step time (a dict)."""
        from .summary import summary
        return summary(self)

    def report(self) -> str:
        """:meth:`summary` as readable tables."""
        from .summary import report
        return report(self)

    def one_line(self) -> str:
        """The summary in one line, as ``parallelize`` prints it."""
        from .summary import one_line
        return one_line(self)


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
