"""Pipeline policies by name (what ``python -m verify model --policy`` accepts): the number of
stages, the policy that partitions each stage over its own ranks, and the schedule.

===================  ==========================================================================
``pp``               one stage per rank (pp = world size), 1F1B
``pp_gpipe``         one stage per rank, GPipe
``pp2_tp``           2 stages, each tensor-parallel (``tp``) over world/2 ranks, 1F1B
``pp2_tp_gpipe``     the same under GPipe
``pp2_dp``           2 stages, each data-parallel (``dp``) over world/2 ranks, 1F1B
``pp2_dp_gpipe``     the same under GPipe
``pp2_random``       2 stages, each a seeded random valid partition per operator (``random``) over
                     world/2 ranks, 1F1B: the harness's draw over pipeline meshes
``pp2_hybrid``       2 stages, each ``hybrid`` (dp x tp, ``tp_size`` inside) over world/2 ranks, 1F1B:
                     at world size 8, pp2 x dp2 x tp2
``pp_interleaved``   two stages per rank (2 x world stages), interleaved 1F1B
``pp_zb``            two stages per rank, interleaved zero-bubble (input and weight gradients apart)
``pp2_cp_tp``        2 stages, each ``cp_tp`` (cp x tp, :mod:`nnscaler.policies.cp_mesh`) over world/2 ranks,
                     1F1B: at world size 4, pp2 x cp2; at 8, pp2 x cp2 x tp2 (run where named, as ``cp``)
``pp2_cp_tp_balanced`` the same with each stage ``cp_tp_balanced`` (Llama 3's causally balanced chunks)
``pp2_cp_tp_ring``   the same with each stage ``cp_tp_ring_balanced`` (ring exchange, balanced chunks)
``pp2_cp_tp_ulysses`` the same with each stage ``cp_tp_ulysses`` (Ulysses all-to-all on cp, heads on tp):
                     at world size 4, pp2 x cp2 Ulysses; at 8, pp2 x tp2 x cp2
===================  ==========================================================================
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..config import ComputeConfig


@dataclass(frozen=True)
class PipelinePolicy:
    pp_size: int | None  # None: the world size
    stage_policy: str
    schedule: str

    def pp(self, world_size: int) -> int:
        return world_size if self.pp_size is None else self.pp_size


PIPELINE_POLICIES = {
    "pp": PipelinePolicy(None, "dp", "1F1B"),
    "pp_gpipe": PipelinePolicy(None, "dp", "GPipe"),
    "pp2_tp": PipelinePolicy(2, "tp", "1F1B"),
    "pp2_tp_gpipe": PipelinePolicy(2, "tp", "GPipe"),
    "pp2_dp": PipelinePolicy(2, "dp", "1F1B"),
    "pp2_dp_gpipe": PipelinePolicy(2, "dp", "GPipe"),
    "pp2_random": PipelinePolicy(2, "random", "1F1B"),
    "pp2_hybrid": PipelinePolicy(2, "hybrid", "1F1B"),
    "pp_interleaved": PipelinePolicy(None, "dp", "Interleaved1F1B"),
    "pp_zb": PipelinePolicy(None, "dp", "InterleavedZeroBubble"),
    "pp2_cp_tp": PipelinePolicy(2, "cp_tp", "1F1B"),
    "pp2_cp_tp_balanced": PipelinePolicy(2, "cp_tp_balanced", "1F1B"),
    "pp2_cp_tp_ring": PipelinePolicy(2, "cp_tp_ring_balanced", "1F1B"),
    "pp2_cp_tp_ulysses": PipelinePolicy(2, "cp_tp_ulysses", "1F1B"),
}
# what verify all sweeps: each mesh of the issue under 1F1B and GPipe, random stage plans, and the
# interleaved schedules (pp2_* need world size 4; a model with fewer layers than stages is skipped)
SWEPT = ("pp", "pp_gpipe", "pp2_tp", "pp2_tp_gpipe", "pp2_dp", "pp2_dp_gpipe", "pp2_random", "pp_interleaved",
         "pp_zb")


def is_pipeline_policy(policy) -> bool:
    return isinstance(policy, str) and policy in PIPELINE_POLICIES


def applies(policy: str, world_size: int) -> bool:
    """Whether a pipeline policy runs at ``world_size`` (a 2-stage policy of more than one rank per
    stage needs a world of 4 or more)."""
    p = PIPELINE_POLICIES[policy]
    return world_size % p.pp(world_size) == 0 and (p.pp_size is None or world_size > p.pp_size)


def pipeline_config(policy, config: ComputeConfig) -> tuple[Any, ComputeConfig]:
    """``(stage policy, config)``: a pipeline policy's name sets ``pp_size`` and the schedule. A context-parallel
    stage (``pp2_cp_*``) keeps a cp axis of 2 ranks at least: ``tp_size`` gives way where the stage's ranks would
    all go to tp (at world size 4, tp 2 left each 2-rank stage no cp: pp2 x cp2 instead)."""
    if isinstance(policy, str) and policy in PIPELINE_POLICIES:
        p = PIPELINE_POLICIES[policy]
        pp = p.pp(config.plan_ngpus)
        tp = config.tp_size
        k = config.plan_ngpus // pp
        if p.stage_policy.startswith("cp_") and k // (tp or k) < 2:
            tp = max(1, k // 2)
        return p.stage_policy, dataclasses.replace(config, pp_size=pp, schedule=p.schedule, tp_size=tp)
    return policy, config


def stage_config(config: ComputeConfig) -> ComputeConfig:
    """The config each stage is planned under: its own ``plan_ngpus // pp_size`` ranks, no replicas
    (those are the whole pipeline's), ``tp_size`` capped at them (``hybrid`` stages: dp x tp)."""
    k = config.plan_ngpus // config.pp_size
    return dataclasses.replace(config, plan_ngpus=k, runtime_ngpus=None, pp_size=1, schedule="1F1B",
                               pp_split=None, virtual_stages=None, tp_size=min(config.tp_size or k, k))
