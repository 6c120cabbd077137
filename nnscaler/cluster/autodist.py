"""``autodist`` at every scale: ``nnscaler.plan_model`` and ``nnscaler.parallelize``, the one planner's face.

A request for ``"autodist"`` is a cluster-scale one when it gives ``global_batch`` or ``constraints``,
or names a device profile with cluster constants (``h100``, ``a100``, ...) for a model built of a stack
of repeated blocks (:func:`~nnscaler.cluster.trace.block_stack`). Such a request searches the outer
configuration on the cluster cost model (:func:`~nnscaler.cluster.search.search`: tp with or without
sequence parallelism, pipeline stages and schedule with virtual stages, micro-batching, dp with a
ZeRO stage, recompute, precision); inside a stage every operator keeps Megatron-LM's template (the
lowering's ``tp``/``hybrid``/``dp`` policy, :func:`~nnscaler.cluster.plan.lower`), and the plan report
says so: the per-operator search inside a stage is not done yet. The plan is a
:class:`~nnscaler.ir.plan.Plan` like any other (``policy="autodist"``, mesh ``(pp, dp, tp)``) whose
estimate (:class:`ClusterStats`) prints through ``Plan.summary()`` / ``report()`` / ``one_line()``.

Any other request runs the per-operator integer program (:mod:`nnscaler.policies.autodist`) as before;
when that finds no plan that fits memory on a cluster profile, the cluster search is tried (pipeline
stages, ZeRO and recompute reach what a per-operator split cannot) and an error names both searches;
without a cluster profile the error says how to ask for one.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Mapping, Sequence

import torch

from ..compile.parallelize import parallelize as compile_program
from ..compile.plan import plan_model as plan_operators
from ..config import ComputeConfig, PlanError
from ..ir.plan import Plan, Policy
from ..profiles import get_profile
from .plan import architecture_of, cp_refusal, stage_policy
from .search import ClusterPlan, search
from .trace import block_stack, trace_shape

INSIDE_STAGE = ("inside a stage: Megatron-LM's template (policy {policy}: column- then row-parallel linears, "
                "attention by heads, vocabulary-parallel embedding and loss); the per-operator search "
                "inside a stage is not done yet")


class ClusterStats:
    """The estimate of a cluster-scale autodist plan (the :class:`~nnscaler.ir.plan.PlanCost` of its
    :class:`Plan`): the :class:`ClusterPlan` the cluster search chose (``cluster``), printed as every
    plan is (``summary`` / ``report`` / ``one_line``)."""

    def __init__(self, cluster: ClusterPlan):
        self.cluster = cluster
        self.profile = cluster.profile

    @property
    def step_seconds(self) -> float:
        return self.cluster.best.step_seconds

    @property
    def peak_bytes(self) -> list[float]:
        return [self.cluster.best.memory["peak"]]  # every rank of a stage alike; the fullest stage's

    @property
    def mfu(self) -> float:
        return self.cluster.best.mfu

    def inside_stage(self) -> str:
        p = self.cluster.parallel
        if cp_refusal(p):
            return "inside a stage: " + cp_refusal(p)
        if p.cp > 1 and p.cp_scheme == "ulysses":
            within = " inside each tp rank's heads" if p.tp > 1 else ""
            return (f"inside a stage: policy {stage_policy(p)}; the sequence in {p.cp} contiguous chunks on the cp "
                    f"axis, attention split by heads on it{within} (all-to-all of q, k, v and the output)")
        if p.cp > 1 and p.cp_scheme == "ring":
            return (INSIDE_STAGE.format(policy=stage_policy(p)) + f"; the sequence in {p.cp} "
                    f"{'balanced' if p.cp_balanced else 'contiguous'} chunks on the cp axis, keys and values exchanged "
                    f"around the ring")
        if p.cp > 1:
            chunks = f"{2 * p.cp} chunks, two per rank (causally balanced)" if p.cp_balanced else \
                f"{p.cp} contiguous chunks"
            return (INSIDE_STAGE.format(policy=stage_policy(p)) + f"; the sequence in {chunks} on the cp axis, "
                    f"keys and values all-gathered")
        if self.cluster.parallel.tp == 1:
            return "inside a stage: every operator whole on its rank (tp 1, policy dp)"
        return INSIDE_STAGE.format(policy=stage_policy(self.cluster.parallel))

    def summary(self, plan: Plan) -> dict:
        return {**self.cluster.summary(), "policy": plan.policy, "mesh_shape": list(plan.mesh_shape),
                "axis_names": list(plan.axis_names), "planner": "cluster search",
                "stage_policy": stage_policy(self.cluster.parallel), "inside_stage": self.inside_stage(),
                "note": plan.note}

    def report(self, plan: Plan) -> str:
        c = self.cluster
        return (f"plan {plan.policy} on mesh {plan.mesh_shape} {plan.axis_names} (outer configuration by the "
                f"cluster search)\n" + c.report() + f"global batch {c.global_batch} sequences of {c.shape.seq} "
                f"tokens (default: the sample's batch on every rank; ComputeConfig(global_batch=...) sets it)\n"
                + self.inside_stage() + "\n")

    def one_line(self, plan: Plan) -> str:
        return f"plan {plan.policy}: " + self.cluster.one_line()

    def save(self, path: str | os.PathLike):
        """Write the plan file ``python -m verify plan PATH`` checks (:meth:`ClusterPlan.save`)."""
        return self.cluster.save(path)


def as_plan(cluster: ClusterPlan) -> Plan:
    """The :class:`Plan` of a cluster search's result: mesh ``(pp, dp, tp)``, policy ``autodist``, no
    per-operator partitions of its own (those are the lowering's, :func:`~nnscaler.cluster.plan.lower`); with
    context parallelism the mesh is ``(pp, dp, cp, tp)``."""
    p = cluster.parallel
    stats = ClusterStats(cluster)
    if p.cp > 1:  # rank order tp, cp, dp, pp (nnscaler.cluster.cost)
        return Plan((p.pp, p.dp, p.cp, p.tp), ("pp", "dp", "cp", "tp"), {}, "autodist", stats=stats,
                    note=stats.inside_stage())
    return Plan((p.pp, p.dp, p.tp), ("pp", "dp", "tp"), {}, "autodist", stats=stats, note=stats.inside_stage())


def _cluster_profile(config: ComputeConfig) -> bool:
    return config.profile is not None and get_profile(config.profile).cluster is not None


def cluster_scale(model: torch.nn.Module, config: ComputeConfig) -> bool | None:
    """``True`` when ``config`` asks for a cluster plan (``global_batch`` or ``constraints``), ``None``
    when it may (a cluster profile and a model of repeated blocks), ``False`` otherwise."""
    if config.global_batch is not None or config.constraints:
        return True
    return None if _cluster_profile(config) and block_stack(model) is not None else False


def _search(model, sample_args, sample_kwargs, config: ComputeConfig, required: bool, refuse=None) -> Plan | None:
    """The cluster search's plan, or ``None`` when the model is not one it reads and ``required`` is false
    (``refuse``: :func:`~nnscaler.cluster.search.search`'s filter of configurations)."""
    t0 = time.perf_counter()
    try:
        shape = trace_shape(model, sample_args, sample_kwargs)
    except PlanError:
        if required:
            raise
        return None
    arch = architecture_of(model)
    cluster = search(shape, config, arch["transformers"] if arch else type(model).__name__, refuse)
    cluster.architecture = arch
    cluster.seconds = time.perf_counter() - t0  # the whole planning, trace included (as plan_cluster)
    return as_plan(cluster)


def plan_model(model: torch.nn.Module, sample_args: Sequence[Any], policy: str | Policy, config: ComputeConfig,
               sample_kwargs: Mapping[str, Any] | None = None, **options) -> Plan:
    """Plan ``model`` for ``config.plan_ngpus`` ranks with no process group (``options``: those of
    :func:`nnscaler.compile.plan.plan_model`). ``"autodist"`` plans at every scale (module docstring):
    a cluster-scale request's plan is the cluster search's, ``plan.stats.cluster`` the
    :class:`ClusterPlan` (``.save(PATH)`` for ``python -m verify plan``, ``.lower()`` for the compiler)."""
    if policy != "autodist":
        return plan_operators(model, sample_args, policy, config, sample_kwargs, **options)
    wanted = cluster_scale(model, config)
    if wanted is not False:
        plan = _search(model, sample_args, sample_kwargs, config, required=bool(wanted))
        if plan is not None:
            return _unverified(plan, options)
    try:
        return plan_operators(model, sample_args, policy, config, sample_kwargs, **options)
    except PlanError as exc:
        if "fits mem_budget" not in str(exc) or wanted is None:  # None: the cluster search could not read it
            raise
        if not _cluster_profile(config):
            raise PlanError(f"{exc}; pipeline stages, ZeRO and recompute are searched for a device: give "
                            f"ComputeConfig(profile='h100', ...) and autodist plans the cluster "
                            f"(nnscaler.cluster.plan_cluster)") from None
        try:
            plan = _search(model, sample_args, sample_kwargs, config, required=False)
        except PlanError as outer:
            raise PlanError(f"{exc}; the cluster search (pipeline stages, ZeRO, recompute) finds none either: "
                            f"{outer}") from None
        if plan is None:
            raise
        return _unverified(plan, options)


def _unverified(plan: Plan, options: dict) -> Plan:
    """``plan``, unless ``options`` ask ``plan_model`` to verify it (a cluster plan is verified from its file)."""
    if options.get("verify"):
        raise PlanError("plan_model(verify=...) verifies per-operator plans; a cluster plan is verified from its "
                        "file: plan.stats.save(PATH), then python -m verify plan PATH")
    return plan


PLANNED = ("num_microbatches", "precision", "zero", "recompute")  # the recipe fields a cluster plan sets


def lowered(plan: Plan, config: ComputeConfig) -> tuple[str, ComputeConfig]:
    """``(policy, config)`` the compiler runs for a cluster-scale autodist ``plan``, keeping ``config``'s
    profile, seed, memory budget and the recipe fields the plan does not set (clipping, buckets, ...)."""
    policy, cfg = plan.stats.cluster.lower(profile=config.profile, seed=config.seed, mem_budget=config.mem_budget)
    kept = {f.name: getattr(config.recipe, f.name) for f in dataclasses.fields(config.recipe) if f.name not in PLANNED}
    return policy, dataclasses.replace(cfg, recipe=dataclasses.replace(cfg.recipe, **kept))


def lowering(model: torch.nn.Module, sample_args: Sequence[Any], policy: str | Policy, config: ComputeConfig,
             sample_kwargs: Mapping[str, Any] | None = None) -> tuple[str | Policy, ComputeConfig]:
    """``(policy, config)`` :func:`parallelize` compiles: a cluster-scale ``"autodist"`` request searched and
    lowered (see :func:`parallelize`), any other request as given."""
    wanted = cluster_scale(model, config) if policy == "autodist" else False
    if wanted is False:
        return policy, config
    cons = config.constraints or {}
    refuse = None if "cp_scheme" in cons else cp_refusal  # a plan to compile: what the compiler lowers
    x = sample_args[0] if sample_args else None
    if config.global_batch is None and isinstance(x, torch.Tensor) and x.dim() >= 2:
        config = dataclasses.replace(config, global_batch=int(x.shape[0]))
    plan = _search(model, sample_args, sample_kwargs, config, required=bool(wanted), refuse=refuse)
    return (policy, config) if plan is None else lowered(plan, config)


def parallelize(model: torch.nn.Module, sample_args: Sequence[Any], policy: str | Policy, config: ComputeConfig,
                **options) -> torch.nn.Module:
    """:func:`nnscaler.compile.parallelize.parallelize` (``options``: its keywords), with ``"autodist"``
    planning at every scale: a cluster-scale request is searched as :func:`plan_model` does and the
    program compiled for what its plan lowers to (:func:`lowered`: pipeline stages, micro-batches,
    ZeRO, recompute, precision, the cp scheme's policy; Megatron-LM's template inside a stage); that search
    admits only the configurations the compiler lowers (:func:`~nnscaler.cluster.plan.cp_refusal`: every cp
    scheme it accepts, no sequence parallelism under cp) unless ``constraints`` name the
    cp scheme (one it lacks is then refused by name). ``sample_args`` is the batch the
    module is called with, across its ranks, so ``global_batch`` defaults to its batch here (not to the
    sample's batch on every rank, as in :func:`plan_model`)."""
    policy, config = lowering(model, sample_args, policy, config, options.get("sample_kwargs"))
    return compile_program(model, sample_args, policy, config, **options)
