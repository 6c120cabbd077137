"""The ``torchpar`` kind: the user's own torch parallelization trained against one device
(:mod:`verify.cases.torchpar.case`), localised by module hooks (:mod:`verify.cases.torchpar.localize`);
in the sweep, one built-in case (``verify/rows/torchpar_builtin.py``) at its world size."""
from __future__ import annotations

from dataclasses import dataclass, replace

from verify.cases.torchpar.case import run_torchpar_job
from verify.cases.torchpar.localize import localize_torchpar
from verify.config import RunConfig
from verify.kinds.registry import CaseKind, case_kind


@case_kind("torchpar")
@dataclass(frozen=True)
class Torchpar(CaseKind):
    """Keys: model, parallelize, mesh [[name, size], ...], world_size, steps, seed, gen_dir, dtype."""

    @classmethod
    def label(cls, unit) -> str:
        return f"torchpar:{unit.name} W={unit.world_sizes[0]}"

    @classmethod
    def rerun_command(cls, cfg: RunConfig, model: str, fn_ref: str, mesh: str, world_size: int, seed: int,
                      steps: int) -> str:
        """The command that reruns one torch-parallelization row alone (its dtype; no ``--module``: torch's
        own modules run)."""
        return replace(cfg, modules=()).command("model", model, [
            ("--parallelize", fn_ref), ("--mesh", mesh), ("--world-size", world_size), ("--seed", seed),
            ("--steps", steps), ("--dtype", cfg.dtype)])

    def run(self, state) -> dict:
        return {"checks": [c.__dict__ for c in run_torchpar_job(self.job, state.groups, state.crumb)]}

    def localize(self, state, first_failure: str):
        return localize_torchpar(self.job, state.groups, first_failure)
