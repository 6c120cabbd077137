"""The ``torchpar`` kind: the user's own torch parallelization trained against one device
(:mod:`verify.cases.torchpar.case`), localised by module hooks (:mod:`verify.cases.torchpar.localize`)."""
from __future__ import annotations

from dataclasses import dataclass

from verify.cases.torchpar.case import run_torchpar_job
from verify.cases.torchpar.localize import localize_torchpar
from verify.kinds.registry import CaseKind, case_kind


@case_kind("torchpar")
@dataclass(frozen=True)
class Torchpar(CaseKind):
    """Keys: model, parallelize, mesh [[name, size], ...], world_size, steps, seed, gen_dir, dtype."""

    def run(self, state) -> dict:
        return {"checks": [c.__dict__ for c in run_torchpar_job(self.job, state.groups, state.crumb)]}

    def localize(self, state, first_failure: str):
        return localize_torchpar(self.job, state.groups, first_failure)
