"""``nnscaler.plan_model``: trace and plan for any number of ranks without a process group, and the
cost estimate every plan carries (``Plan.summary()`` / ``Plan.report()``)."""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from .cost.estimate import analyze
from .cost.profiles import get_profile
from .ir.graph import IRGraph
from .ops.registry import OpRegistry
from .policies import POLICIES, ComputeConfig, Plan, PlanError, validate
from .policies.coverage import replicated_operators
from .policies.plan import Policy
from .policies.summary import param_fraction
from .trace.build import trace

REPORT_NAME = "plan_report.txt"
SUMMARY_NAME = "plan_summary.json"
SLACK = 0.10  # a tensor-parallel plan may keep 1/W + 10% of the parameters per rank before it warns


class PlanWarning(UserWarning):
    """A plan that does not deliver what its policy promises."""


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


def attach_stats(plan: Plan, graph: IRGraph, config: ComputeConfig) -> Plan:
    """Give ``plan`` its cost estimate (``plan.stats``) and warn when a policy promising tensor
    parallelism keeps more than 1/W + 10% of the parameters on a rank."""
    plan.stats = analyze(graph, plan, get_profile(config.profile), config.replicas)
    plan.stats.replicated_ops = [(r.op.name, r.op.overload, r.reason) for r in replicated_operators(graph, plan)]
    t = _promised_tp(plan)
    frac = param_fraction(plan.stats)
    if t > 1 and frac > 1 / t + SLACK and plan.policy == "autodist" and not plan.stats.sharded:
        warnings.warn(f"autodist ran the whole model on every rank (no tensor split on its tp axis of {t}): on "
                      f"profile {config.profile} no partition it searched beat that (estimated step "
                      f"{1e3 * plan.stats.step_seconds:.3g} ms); on tiny models this is expected, use tp or dp "
                      f"to force a split", PlanWarning, stacklevel=3)
    elif t > 1 and frac > 1 / t + SLACK:
        warnings.warn(f"policy {plan.policy} promises tensor parallelism of degree {t} but a rank keeps "
                      f"{100 * frac:.0f}% of the parameters (at most {100 * (1 / t + SLACK):.0f}% expected); "
                      f"see Plan.report() for what stays whole", PlanWarning, stacklevel=3)
    return plan


def write_report(plan: Plan, directory: str | os.PathLike) -> Path:
    """Write ``plan_report.txt`` and ``plan_summary.json`` into ``directory``; returns the report's path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / SUMMARY_NAME).write_text(json.dumps(plan.summary(), indent=1) + "\n")
    path = d / REPORT_NAME
    path.write_text(plan.report())
    return path


def plan_graph(graph: IRGraph, policy: str | Policy, config: ComputeConfig) -> Plan:
    """Run ``policy`` on a traced graph, check the plan and attach its cost estimate."""
    name, fn = resolve_policy(policy)
    plan = fn(graph, config)
    if not isinstance(plan, Plan):
        raise PlanError(f"policy {name} returned {type(plan).__name__}, not a Plan")
    validate(plan, graph, config)
    return attach_stats(plan, graph, config)


def plan_model(model: torch.nn.Module, sample_args: Sequence[Any], policy: str | Policy, config: ComputeConfig,
               sample_kwargs: Mapping[str, Any] | None = None, *, registry: OpRegistry | None = None,
               strict: bool = False, verify: str | bool = False, verify_cache: str | os.PathLike | None = None
               ) -> Plan:
    """Trace ``model`` and plan it for ``config.plan_ngpus`` ranks, with no process group.

    A model built under ``with torch.device("meta"):`` (and meta sample arguments) plans without
    allocating its weights. The plan carries its cost estimate: ``plan.summary()``, ``plan.report()``.
    ``verify="strict"`` / ``"warn"`` verifies every (operator, partition) pair of the plan on a local
    gang of ``plan_ngpus`` ranks launched for it (as ``parallelize`` does on its process group; same
    cache); default ``False``.
    """
    if verify not in ("strict", "warn", False):
        raise PlanError(f"verify must be 'strict', 'warn' or False, got {verify!r}")
    graph = trace(model, sample_args, sample_kwargs, registry=registry, strict=strict)
    canonical_params(model, graph)
    plan = plan_graph(graph, policy, config)
    if verify and plan.world_size > 1:
        from verify.plan_offline import verify_offline  # the harness, imported only when asked for

        from .parallel import judge_verdicts
        judge_verdicts(verify_offline(graph, plan, cache_path=verify_cache), verify, stacklevel=3)
    return plan
