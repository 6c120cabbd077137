"""From a model to a checked plan: trace, name tied parameters once, run the policy (the only place a
policy is called and its result checked), attach the cost estimate every plan carries
(``Plan.summary()`` / ``Plan.report()``); and :func:`plan_model`, all of that for any number of ranks
without a process group (``nnscaler.plan_model`` is it, with ``"autodist"`` also planning at cluster
scale: :mod:`nnscaler.cluster.autodist`)."""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from ..config import ComputeConfig, PlanError, PlanWarning
from ..cost.causes import forward_causes
from ..cost.estimate import analyze
from ..profiles import get_profile
from ..cost.summary import human, param_fraction
from ..dimops.partition import Partition
from ..ir.graph import GUARD, IRGraph
from ..ir.plan import Plan, Policy, validate
from ..ops.registry import OpRegistry
from ..policies import POLICIES
from ..policies.coverage import replicated_operators
from ..trace.build import Tracer, trace
from .gate import Verifier, check_mode, verify_offline
from .precision import apply_precision

REPORT_NAME = "plan_report.txt"
SUMMARY_NAME = "plan_summary.json"
SLACK = 0.10  # a tensor-parallel plan may keep 1/W + 10% of the parameters per rank before it warns


def _warn(message: str, stacklevel: int) -> None:
    """Warn :class:`PlanWarning` on the job's driving process only (no process group, or its rank 0):
    every rank plans alike, so a warning per rank would say the same thing W times."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        warnings.warn(message, PlanWarning, stacklevel=stacklevel + 1)


def resolve_policy(policy: str | Policy) -> tuple[str, Policy]:
    """``(name, function)`` of a built-in policy's name or a user's function."""
    if callable(policy):
        return getattr(policy, "__name__", "custom"), policy
    if policy not in POLICIES:
        raise PlanError(f"unknown policy {policy!r}; built in: {', '.join(POLICIES)} (or pass a function)")
    return policy, POLICIES[policy]


def canonical_params(model: torch.nn.Module, graph: IRGraph) -> None:
    """Name tied parameters by their first name (as ``named_parameters()`` lists them), once each."""
    canonical = {}
    for n, p in model.named_parameters():
        canonical.setdefault(id(p), n)
    by_target: dict[str, object] = {}
    for t in graph.params:
        t.target = canonical.get(id(model.get_parameter(t.target)), t.target)
        if t.target not in by_target or (t.consumers and not by_target[t.target].consumers):
            by_target[t.target] = t  # export may list a tied parameter twice, using one of them
    graph.params[:] = list(by_target.values())


def _promised_tp(plan: Plan) -> int:
    """The tensor-parallel degree a plan's policy promises (1: none)."""
    if plan.policy == "tp":
        return plan.world_size
    if "tp" in plan.axis_names and plan.policy in ("hybrid", "autodist"):
        return plan.mesh_shape[plan.axis_names.index("tp")]
    return 1


def attach_stats(plan: Plan, graph: IRGraph, config: ComputeConfig, steps: list | None = None) -> Plan:
    """Give ``plan`` its cost estimate (``plan.stats``) and warn when a policy promising tensor
    parallelism keeps more than 1/W + 10% of the parameters on a rank. ``steps``: the conversion steps
    of the program when it is already emitted (see :func:`nnscaler.cost.estimate.analyze`)."""
    plan.stats = analyze(graph, plan, get_profile(config.profile), config.replicas, steps, config.zero,
                         config.recompute, config.recompute_modules)
    plan.stats.replicated_ops = [(r.op.name, r.op.overload, r.reason) for r in replicated_operators(graph, plan)]
    plan.stats.causes = lambda: forward_causes(graph, plan)
    plan.stats.guards = list(dict.fromkeys(op.source for op in graph.ops if op.overload == GUARD))
    plan.stats.inferred = sorted({(op.spec.name, op.spec.annotation) for op in graph.ops
                                  if op.spec is not None and op.spec.family == "inferred"})
    t = _promised_tp(plan)
    frac = param_fraction(plan.stats)
    if t > 1 and frac > 1 / t + SLACK and plan.policy == "autodist" and not plan.stats.sharded:
        _warn(f"autodist ran the whole model on every rank (no tensor split on its tp axis of {t}): on "
              f"profile {config.profile} no partition it searched beat that (estimated step "
              f"{1e3 * plan.stats.step_seconds:.3g} ms); on tiny models this is expected, use tp or dp "
              f"to force a split", stacklevel=3)
    elif t > 1 and frac > 1 / t + SLACK:
        _warn(f"policy {plan.policy} promises tensor parallelism of degree {t} but a rank keeps "
              f"{100 * frac:.0f}% of the parameters (at most {100 * (1 / t + SLACK):.0f}% expected); "
              f"see Plan.report() for what stays whole", stacklevel=3)
    _warn_over_budget(plan, config)
    return plan


def _warn_over_budget(plan: Plan, config: ComputeConfig) -> None:
    """Warn when the plan's estimated peak per rank exceeds ``config.mem_budget`` or the profile's
    device memory (a plan for a cluster that cannot run on it, whichever policy made it)."""
    profile = get_profile(config.profile)
    peak = max(plan.stats.peak_bytes, default=0)
    limit, what = ((config.mem_budget, "mem_budget") if config.mem_budget is not None
                   else (profile.memory, f"the {profile.name} profile's device memory"))
    if peak > limit:
        _warn(f"policy {plan.policy}: estimated peak {human(peak)} per rank exceeds {what} of {human(limit)}: "
              f"the plan would not fit; use more ranks, tensor parallelism or autodist with "
              f"ComputeConfig(mem_budget=...)", stacklevel=4)


def write_report(plan: Plan, directory: str | os.PathLike) -> Path:
    """Write ``plan_report.txt`` and ``plan_summary.json`` into ``directory``; returns the report's path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / SUMMARY_NAME).write_text(json.dumps(plan.summary(), indent=1) + "\n")
    path = d / REPORT_NAME
    path.write_text(plan.report())
    return path


def trace_model(model: torch.nn.Module, sample_args: Sequence[Any], sample_kwargs: Mapping[str, Any] | None, *,
                registry: OpRegistry | None, strict: bool, tracer: Tracer | None = None) -> IRGraph:
    """The traced graph of ``model`` on the sample, tied parameters named once each."""
    graph = (tracer or trace)(model, sample_args, sample_kwargs, registry=registry, strict=strict)
    canonical_params(model, graph)
    return graph


def choose_plan(graph: IRGraph, policy: str | Policy, config: ComputeConfig) -> Plan:
    """Run ``policy`` on a traced graph and check what it returns (a :class:`Plan` of
    :class:`Partition` s that lie on its mesh and fit every operator), without its cost estimate."""
    name, fn = resolve_policy(policy)
    plan = fn(graph, config)
    if not isinstance(plan, Plan):
        raise PlanError(f"policy {name} returned {type(plan).__name__}, not a Plan")
    odd = next(((k, v) for k, v in plan.partitions.items() if not isinstance(v, Partition)), None)
    if odd is not None:
        raise PlanError(f"policy {name} gave operator {odd[0]} a {type(odd[1]).__name__} ({odd[1]!r}), not a "
                        f"Partition (use Partition.parse(label, world_size))")
    validate(plan, graph, config)
    return plan


def plan_graph(graph: IRGraph, policy: str | Policy, config: ComputeConfig) -> Plan:
    """Run ``policy`` on a traced graph, check the plan and attach its cost estimate."""
    return attach_stats(choose_plan(graph, policy, config), graph, config)


def plan_model(model: torch.nn.Module, sample_args: Sequence[Any], policy: str | Policy, config: ComputeConfig,
               sample_kwargs: Mapping[str, Any] | None = None, *, registry: OpRegistry | None = None,
               strict: bool = False, verify: str | bool = False, verify_cache: str | os.PathLike | None = None,
               verifier: Verifier | None = None) -> Plan:
    """Trace ``model`` and plan it for ``config.plan_ngpus`` ranks, with no process group.

    A model built under ``with torch.device("meta"):`` (and meta sample arguments) plans without
    allocating its weights. The plan carries its cost estimate: ``plan.summary()``, ``plan.report()``.
    ``verify="strict"`` / ``"warn"`` verifies every (operator, partition) pair of the plan with no
    process group (the installed verifier, or ``verifier``, starts ``plan_ngpus`` local ranks for it,
    as ``parallelize`` verifies on its process group; same cache); default ``False``.
    """
    check_mode(verify)
    graph = trace_model(model, sample_args, sample_kwargs, registry=registry, strict=strict)
    plan = choose_plan(graph, policy, config)
    verify_offline(graph, plan, verify, verifier, verify_cache)
    apply_precision(graph, config.precision)  # bf16-mixed's casts: the saved activations' dtypes
    return attach_stats(plan, graph, config)
