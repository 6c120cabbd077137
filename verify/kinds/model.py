"""The ``model`` kind: a whole model under a policy trained against one device (:mod:`verify.cases.model`,
a pipeline policy stage by stage), or, planned on fewer ranks than the case's (``plan_ngpus``), as
replicas (:mod:`verify.cases.replicas`); a failing row is localised (:mod:`verify.localize.row`). In the
sweep, a unit is one model case (its policy, micro-batches, replicas, recipe, resume)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from nnscaler.recipe import Recipe

from verify.cases.memory import MemoryLog
from verify.cases.model import run_model_job
from verify.cases.replicas import run_replicas_job
from verify.cases.traces import TraceCache, graph_ops
from verify.config import RECIPE, RunConfig, model_label
from verify.kinds.registry import CaseKind, case_kind
from verify.localize.row import localize_row


def traces_of(state) -> TraceCache:
    """The rank's traced models (traced once, compiled under many plans)."""
    return state.kept.setdefault("traces", TraceCache())


@case_kind("model")
@dataclass(frozen=True)
class Model(CaseKind):
    """Keys: model, policy, world_size, steps, seed, gen_dir, and optionally plan_ngpus (replicas), dtype,
    bucket_bytes, microbatches, checkpoint, layout and the recipe's keys (handed on as they come)."""

    @property
    def replicas(self) -> bool:
        return self.job.get("plan_ngpus", self.job["world_size"]) < self.job["world_size"]

    def run(self, state) -> dict:
        log = MemoryLog()  # what a whole-model case measured on this rank (verify/cases/memory.py)
        traces = traces_of(state)
        run = run_replicas_job if self.replicas else run_model_job
        checks = run(self.job, state.groups, traces, log)
        return {"checks": [c.__dict__ for c in checks], "memory": log.last, "used": graph_ops(traces, self.job["model"])}

    def localize(self, state, first_failure: str):
        return localize_row(self.job, first_failure, state.groups)

    @classmethod
    def label(cls, unit) -> str:
        """``model:nanogpt tp mb4 W=2 seed 1 no-resume``: the row's partition column (:func:`model_label`),
        the sample recipe's words on a recipe unit, the world sizes, seeds and whether it resumes."""
        policy = model_label(unit.policy, Recipe(num_microbatches=unit.microbatches), unit.replicas)
        return (f"model:{unit.name} {policy}{RECIPE.label if unit.recipe else ''} "
                f"W={','.join(map(str, unit.world_sizes))} seed {','.join(map(str, unit.seeds))}"
                + ("" if unit.checkpoint else " no-resume"))

    @classmethod
    def rerun_command(cls, cfg: RunConfig, model: str, policy: str, world_size: int, seed: int, steps: int,
                      bucket_bytes: int | None = None, replicas: int = 1) -> str:
        """The command that reruns one whole-model row alone (same modules, dtype, steps, recipe; buckets
        of ``bucket_bytes``, else the recipe's; ``--replicas R`` last where the plan is replicated)."""
        recipe = cfg.recipe if bucket_bytes is None else replace(cfg.recipe, bucket_bytes=bucket_bytes)
        line = cfg.command("model", model, [
            ("--policy", policy), ("--world-size", world_size), ("--seed", seed), ("--steps", steps),
            ("--dtype", cfg.dtype), *recipe.flags()])
        return line + (f" --replicas {replicas}" if replicas > 1 else "")
