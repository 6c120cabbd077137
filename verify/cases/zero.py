"""Which whole-model cases a ZeRO stage applies to (``--zero``): a plan with a data-parallel mesh
axis (``dp``, or ``cp``'s (``ulysses``') sequence axis, which holds every parameter whole; ``hybrid``/``hybrid_cp``/``cp_tp``/``cp_tp_ulysses`` where its dp (cp_tp: cp) axis has more than one rank: the harness plans it with
``tp_size=2``) or data-parallel replicas; a pipeline where each stage has one (``pp2_dp`` on 4 or
more ranks) or replicas (zero 3 not under a zero-bubble schedule: ``nnscaler`` refuses it)."""
from __future__ import annotations

from verify.cases.pipeline import is_pipeline_policy

ZERO_BUBBLE = ("pp_zb",)  # pipeline policies on a zero-bubble schedule: no zero 3 (nnscaler refuses it)
STAGE_DP = {"pp2_dp": 4, "pp2_dp_gpipe": 4, "pp2_hybrid": 8, "pp2_cp_tp": 4,
            "pp2_cp_tp_balanced": 4, "pp2_cp_tp_ring": 4, "pp2_cp_tp_ulysses": 4}  # pipeline policy -> ranks from which its stages have a dp axis (pp2_cp_*: the cp axis, 2 ranks at W=4)


def zero_applies(policy: str, plan_ngpus: int, replicas: int = 1, zero: int = 1) -> bool:
    """Whether ``--zero`` (stage ``zero``) can run ``policy`` planned on ``plan_ngpus`` ranks with ``replicas``."""
    if is_pipeline_policy(policy):
        return not (zero >= 3 and policy in ZERO_BUBBLE) \
            and (replicas > 1 or plan_ngpus >= STAGE_DP.get(policy, plan_ngpus + 1))
    if replicas > 1:
        return True
    if policy.startswith(("cp_ring", "cp_tp_ring")):  # the ring scheme: as cp / cp_tp
        policy = "cp" if policy.startswith("cp_ring") else "cp_tp"
    return (policy in ("dp", "cp", "cp_balanced", "ulysses") and plan_ngpus > 1) or (
        policy in ("hybrid", "hybrid_cp", "hybrid_cp_balanced", "cp_tp", "cp_tp_balanced", "cp_tp_ulysses") and plan_ngpus >= 4 and plan_ngpus % 2 == 0)


def zero_refusal(zero: int, policy: str, world_sizes, replicas: int = 1) -> str | None:
    """The one-line reason ``--zero`` cannot run ``policy`` at one of ``world_sizes`` (None: it can)."""
    if not zero:
        return None
    if zero >= 3 and policy in ZERO_BUBBLE:
        return f"--zero {zero}: pipeline policy {policy} (a zero-bubble schedule) takes zero 1 or 2 only; use --zero 2"
    for w in world_sizes:
        if not zero_applies(policy, w // replicas, replicas, zero):
            where = "whose stages have" if is_pipeline_policy(policy) else "has"
            return (f"--zero {zero}: policy {policy} at world size {w} {where} no data-parallel axis to shard over; "
                    f"use --policy dp (or hybrid at W>=4), or --replicas 2")
    return None


def rank_memory(answers) -> list | None:
    """The measured memory of each rank's answer (``verify/cases/memory.py``), by rank; None if none."""
    out = [a.result.get("memory") if a.result else None for a in sorted(answers, key=lambda a: a.rank)]
    return out if any(out) else None
