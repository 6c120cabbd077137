"""The verification gate: before any code is generated, every (operator, partition) pair a plan uses
is verified, and a plan with a failing pair is refused (``"strict"``) or warned about (``"warn"``).

The compiler does not know the harness: the verifier is handed in (``parallelize(verifier=...)``) or
found under the ``nnscaler.verifiers`` entry point, which the harness's distribution installs
(``verify.plan.verifier:HarnessVerifier``). No verifier and ``"strict"``: the plan is refused."""
from __future__ import annotations

import os
import warnings
from importlib.metadata import entry_points
from typing import Any, Iterable, Protocol

import torch.distributed as dist

from ..config import ComputeConfig, PlanError
from ..ir.graph import IRGraph
from ..ir.plan import Plan
from ..runtime.mesh import GroupCache, mesh_shapes

ENTRY_POINT_GROUP = "nnscaler.verifiers"
MODES = ("strict", "warn", False)


class UnverifiedPlanWarning(UserWarning):
    """An operator of the plan failed verification under the partition the plan gives it."""


class Verdict(Protocol):
    """One pair's verdict, as the gate reads it."""
    op: str
    spec: str
    partition: str
    ok: bool
    reason: str


class Verifier(Protocol):
    """What the gate asks of a verifier. ``cache_path``: where verdicts are kept between runs (``None``:
    the verifier's default)."""

    def cached(self, graph: IRGraph, plan: Plan, cache_path: str | os.PathLike | None) -> list[Verdict] | None:
        """Every pair's verdict from the cache, or ``None`` when any pair is not there (no ranks needed)."""

    def on_ranks(self, graph: IRGraph, plan: Plan, *, groups: GroupCache, rank: int,
                 cache_path: str | os.PathLike | None, group: Any) -> list[Verdict]:
        """Verify the plan on its ``plan.world_size`` ranks (collective over ``group``)."""

    def offline(self, graph: IRGraph, plan: Plan, cache_path: str | os.PathLike | None) -> list[Verdict]:
        """Verify the plan with no process group (the verifier starts ranks of its own)."""


def check_mode(verify: Any) -> None:
    if verify not in MODES:
        raise PlanError(f"verify must be 'strict', 'warn' or False, got {verify!r}")


def default_verifier() -> Verifier | None:
    """The verifier installed under the ``nnscaler.verifiers`` entry point (the first, by name), or ``None``."""
    found = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
    if not found:
        return None
    obj = found[0].load()
    return obj() if isinstance(obj, type) else obj


def resolve_verifier(mode: Any, verifier: Verifier | None) -> Verifier | None:
    """The verifier to run under ``mode`` (``None``: verification is off, or ``"warn"`` found none)."""
    check_mode(mode)
    if not mode:
        return None
    verifier = verifier if verifier is not None else default_verifier()
    if verifier is None:
        message = (f"no plan verifier is installed (entry point group {ENTRY_POINT_GROUP!r}): install the harness "
                   f"(pip install -e . from nnscaler-verify) or pass verifier=")
        if mode == "strict":
            raise PlanError(message + ", or pass verify='warn' / False to compile unverified")
        warnings.warn(message, UnverifiedPlanWarning, stacklevel=4)
    return verifier


def judge_verdicts(verdicts: Iterable[Verdict], mode: str, stacklevel: int = 2) -> None:
    """Raise :class:`PlanError` (``"strict"``) or warn :class:`UnverifiedPlanWarning` (``"warn"``)
    when a verdict failed, naming the operators and partitions."""
    bad = [v for v in verdicts if not v.ok]
    if not bad:
        return
    text = "; ".join(f"{v.op} ({v.spec}) under {v.partition}: {v.reason}" for v in bad[:3])
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    if mode == "strict":
        raise PlanError(f"{len(bad)} operator partitions of the plan failed verification: {text}{more}; fix the "
                        f"annotations (python -m verify op NAME) or pass verify='warn'")
    warnings.warn(f"{len(bad)} operator partitions of the plan failed verification: {text}{more}",
                  UnverifiedPlanWarning, stacklevel=stacklevel)


def verify_offline(graph: IRGraph, plan: Plan, mode: Any, verifier: Verifier | None,
                   cache_path: str | os.PathLike | None) -> None:
    """The gate with no process group (``plan_model``)."""
    verifier = resolve_verifier(mode, verifier)
    if verifier is None or plan.world_size == 1:
        return
    judge_verdicts(verifier.offline(graph, plan, cache_path), mode, stacklevel=4)


def verify_on_ranks(graph: IRGraph, plan: Plan, config: ComputeConfig, mode: Any, verifier: Verifier | None,
                    groups: GroupCache, user_groups: bool, cache_path: str | os.PathLike | None) -> None:
    """The gate on the ranks of a process group: the plan ranks (``0 .. plan_ngpus-1``) verify what
    the cache lacks, the replicas take their verdicts; refuse or warn on failures. Collective."""
    verifier = resolve_verifier(mode, verifier)
    n = plan.world_size
    if verifier is None or n == 1:
        return  # one plan rank: nothing is partitioned
    world, rank = dist.get_world_size(), dist.get_rank()
    runtime = config.runtime_ngpus or config.plan_ngpus
    every = None if runtime == world else groups.get(list(range(runtime)))  # all ranks of this module
    verdicts = verifier.cached(graph, plan, cache_path)
    complete: list = [None] * runtime
    dist.all_gather_object(complete, verdicts is not None, group=every)
    if not all(complete):  # something to verify: on the plan ranks, the replicas take their verdicts
        if not user_groups:  # new_group is collective: every rank creates every group, in order
            groups.create_for_shapes(mesh_shapes(n))
        verdicts = None
        if rank < n:
            plan_group = None if n == world else groups.get(list(range(n)))
            verdicts = verifier.on_ranks(graph, plan, groups=groups, rank=rank, cache_path=cache_path,
                                         group=plan_group)
        if runtime > n:
            box = [verdicts]
            dist.broadcast_object_list(box, src=0, group=every)
            verdicts = box[0]
    judge_verdicts(verdicts, mode, stacklevel=5)
