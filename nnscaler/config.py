"""What a plan is asked for, as data: :class:`ComputeConfig` (ranks, mesh, pipeline, cost profile, and
the training recipe as one section, :class:`nnscaler.recipe.Recipe`) and :class:`PlanError`, the one
error every stage of the compiler raises for input it cannot plan.

The bottom of the compiler: it imports only leaf data (the pipeline schedules' names, the device
profiles, the recipe), so every stage above may import it."""
from __future__ import annotations

from dataclasses import dataclass

from .profiles import ProfileError, get_profile
from .recipe import RECOMPUTE as RECOMPUTE_CHOICES, Recipe, RecipeError, with_recipe
from .runtime.precision import bf16_supported, device_type
from .runtime.schedules import SCHEDULES, canonical_schedule, stages_per_rank


class PlanError(ValueError):
    """A plan that cannot run: wrong mesh, an operator without a partition, an invalid split."""


class PlanWarning(UserWarning):
    """A plan that does not deliver what its policy promises (said once per job: ``nnscaler/compile/plan.py``)."""


@with_recipe
@dataclass(frozen=True)
class ComputeConfig:
    """How many ranks one copy of the plan uses (``plan_ngpus``) and how many run in all
    (``runtime_ngpus``, a multiple: the extra copies are data-parallel replicas). ``tp_size`` is
    the tensor-parallel degree of the ``hybrid`` policy; ``seed`` feeds the ``random`` policy.
    ``mem_budget`` (bytes per rank) bounds ``autodist``'s plans; ``profile`` names the device the cost model assumes (``cpu-gloo``,
    ``a100``, ``h100``; default ``cpu-gloo``). ``sequence_parallel``: under ``tp``/``hybrid``, norms,
    dropout and residual adds between the tensor-parallel regions are split along the sequence
    (Megatron-LM's sequence parallelism: each all-reduce becomes a reduce-scatter and an all-gather).

    ``pp_size``/``schedule``/``pp_split``: pipeline stages (see :mod:`nnscaler.compile.pipeline`).

    ``recipe``: the training recipe (:class:`~nnscaler.recipe.Recipe`: micro-batches, precision, ZeRO,
    clipping, recompute, buckets), handed whole to the runtime module. Its fields are also taken as flat
    keywords and read back as properties (``ComputeConfig(8, precision="bf16-mixed", zero=1).zero``)."""

    plan_ngpus: int
    runtime_ngpus: int | None = None
    tp_size: int | None = None
    seed: int = 0
    mem_budget: int | None = None
    profile: str | None = None
    sequence_parallel: bool = False
    # context-parallel degree of the ``cp_tp`` policy (nnscaler.policies.cp_mesh; None: every rank tp leaves)
    cp_size: int | None = None
    # pipeline parallelism (``nnscaler.compile.pipeline``): ``pp_size`` stages of ``plan_ngpus // pp_size`` ranks each,
    # run by ``schedule``; ``pp_split`` names the modules where stages 1.. begin (default: balance the cost model)
    pp_size: int = 1
    schedule: str = "1F1B"
    pp_split: tuple[str, ...] | None = None
    # stages per rank of an interleaved schedule (None: the schedule's default, nnscaler.runtime.schedules)
    virtual_stages: int | None = None
    # cluster planning (nnscaler.cluster.plan_cluster): ``constraints`` fixes any subset of tp, pp, dp,
    # micro_batch_size, num_microbatches, virtual_stages, recompute, zero, sequence_parallel (all of them:
    # evaluate exactly that configuration); ``global_batch``: sequences per optimizer step (default: the
    # sample's batch on every rank)
    constraints: dict | None = None
    global_batch: int | None = None
    recipe: Recipe = Recipe()  # the training recipe (frozen: one default serves every config)

    def __post_init__(self):
        try:
            self.recipe.check()
        except RecipeError as exc:
            raise PlanError(str(exc)) from None
        if self.precision.startswith("bf16") and not bf16_supported():
            raise PlanError(f"precision={self.precision!r}: this {device_type()} device has no bf16 support; "
                            f"use precision='32-true'")
        if self.plan_ngpus < 1:
            raise PlanError(f"plan_ngpus must be at least 1, got {self.plan_ngpus}")
        if self.runtime_ngpus is not None and (self.runtime_ngpus < self.plan_ngpus or self.runtime_ngpus % self.plan_ngpus):
            raise PlanError(f"runtime_ngpus ({self.runtime_ngpus}) must be a multiple of plan_ngpus ({self.plan_ngpus})")
        if self.mem_budget is not None and self.mem_budget <= 0:
            raise PlanError(f"mem_budget must be a positive number of bytes per rank, got {self.mem_budget}")
        if self.pp_size != 1 or self.pp_split is not None or self.schedule != "1F1B" or self.virtual_stages is not None:
            check_config(self)
        if self.global_batch is not None and (isinstance(self.global_batch, bool) or not isinstance(
                self.global_batch, int) or self.global_batch < 1):
            raise PlanError(f"global_batch must be a positive number of sequences, got {self.global_batch!r}")
        if self.constraints is not None:
            check_constraints(self.constraints)
        if self.profile is not None:
            try:
                get_profile(self.profile)
            except ProfileError as exc:
                raise PlanError(str(exc)) from None

    @property
    def replicas(self) -> int:
        return (self.runtime_ngpus or self.plan_ngpus) // self.plan_ngpus


CONSTRAINT_KEYS = ("tp", "pp", "dp", "micro_batch_size", "num_microbatches", "virtual_stages", "recompute", "zero",
        "sequence_parallel", "cp", "cp_scheme", "cp_balanced")
CP_SCHEMES = ("allgather", "ring", "ulysses")  # context parallelism's key/value exchange (nnscaler.cluster.cost)


def check_constraints(constraints: dict | None) -> None:
    """``ComputeConfig.constraints`` (``nnscaler.cluster``): known keys with values of the right
    type. Raises :class:`PlanError`."""
    if constraints is None:
        return
    if not isinstance(constraints, dict):
        raise PlanError(f"constraints must be a dict such as {{'tp': 8, 'pp': 4}}, got {constraints!r}")
    for k, v in constraints.items():
        if k not in CONSTRAINT_KEYS:
            raise PlanError(f"unknown constraint {k!r}; valid: {', '.join(CONSTRAINT_KEYS)}")
        if k == "recompute":
            if v not in RECOMPUTE_CHOICES:
                raise PlanError(f"constraint recompute={v!r}: valid {', '.join(map(repr, RECOMPUTE_CHOICES))}")
        elif k in ("sequence_parallel", "cp_balanced"):
            if not isinstance(v, bool):
                raise PlanError(f"constraint {k}={v!r}: must be True or False")
        elif k == "cp_scheme":
            if v not in CP_SCHEMES:
                raise PlanError(f"constraint cp_scheme={v!r}: valid {', '.join(map(repr, CP_SCHEMES))}")
        elif k == "zero":
            if isinstance(v, bool) or v not in (0, 1, 2, 3):
                raise PlanError(f"constraint zero={v!r}: valid 0, 1, 2, 3")
        elif isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanError(f"constraint {k}={v!r}: must be a positive integer")



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
    v = config.virtual_stages
    if v is not None:
        interleaved = canonical_schedule(config.schedule).startswith("Interleaved")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanError(f"virtual_stages must be a positive integer, got {v!r}")
        if interleaved and v < 2 or not interleaved and v != 1:
            raise PlanError(f"virtual_stages={v} does not fit schedule {config.schedule!r}: "
                            f"{'an interleaved schedule runs 2 or more' if interleaved else 'it runs 1'} per rank")
    if config.pp_split is not None:
        split = config.pp_split
        if isinstance(split, str) or not all(isinstance(s, str) for s in split):
            raise PlanError(f"pp_split must be a tuple of module names (e.g. ('transformer.h.1',)), got {split!r}")
        want = pp * per_rank(config) - 1
        if len(split) != want:
            raise PlanError(f"pp_split names {len(split)} modules but {pp * per_rank(config)} stages "
                            f"need {want} split points")


def per_rank(config) -> int:
    """Pipeline stages per rank: ``virtual_stages`` where given, else the schedule's default."""
    v = getattr(config, "virtual_stages", None)
    return v if v is not None else stages_per_rank(config.schedule)


def n_stages(config) -> int:
    """Pipeline stages in all (``pp_size`` times the stages per rank)."""
    return config.pp_size * per_rank(config)
