"""The ``model`` kind: a whole model under a policy trained against one device (:mod:`verify.cases.model`,
a pipeline policy stage by stage), or, planned on fewer ranks than the case's (``plan_ngpus``), as
replicas (:mod:`verify.cases.replicas`); a failing row is localised (:mod:`verify.localize.row`)."""
from __future__ import annotations

from dataclasses import dataclass

from verify.cases.memory import MemoryLog
from verify.cases.model import run_model_job
from verify.cases.replicas import run_replicas_job
from verify.cases.traces import TraceCache, graph_ops
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
