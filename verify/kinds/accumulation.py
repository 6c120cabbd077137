"""The ``accumulation`` kind: one step of several micro-batches' backward passes against one device on
the whole batch (:mod:`verify.cases.microbatch`)."""
from __future__ import annotations

from dataclasses import dataclass

from verify.cases.microbatch import run_accumulation_job
from verify.kinds.registry import CaseKind, case_kind


@case_kind("accumulation")
@dataclass(frozen=True)
class Accumulation(CaseKind):
    """Keys: model, policy, mode, microbatches, world_size, plan_ngpus, seed, gen_dir."""

    def run(self, state) -> dict:
        return {"checks": [c.__dict__ for c in run_accumulation_job(self.job, state.groups)]}
