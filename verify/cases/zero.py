"""Which whole-model cases a ZeRO stage applies to (``--zero``): a plan with a data-parallel mesh
axis (``dp``; ``hybrid`` where its dp axis has more than one rank: the harness plans it with
``tp_size=2``) or data-parallel replicas; pipelines not yet (``nnscaler`` refuses them)."""
from __future__ import annotations

from verify.cases.pipeline import is_pipeline_policy


def zero_applies(policy: str, plan_ngpus: int, replicas: int = 1) -> bool:
    """Whether ``--zero > 0`` can run ``policy`` planned on ``plan_ngpus`` ranks with ``replicas``."""
    if is_pipeline_policy(policy):
        return False
    if replicas > 1:
        return True
    return (policy == "dp" and plan_ngpus > 1) or (policy == "hybrid" and plan_ngpus >= 4 and plan_ngpus % 2 == 0)


def zero_refusal(zero: int, policy: str, world_sizes, replicas: int = 1) -> str | None:
    """The one-line reason ``--zero`` cannot run ``policy`` at one of ``world_sizes`` (None: it can)."""
    if not zero:
        return None
    for w in world_sizes:
        if not zero_applies(policy, w // replicas, replicas):
            if is_pipeline_policy(policy):
                return f"--zero {zero}: pipeline policy {policy} with zero is not available yet"
            return (f"--zero {zero}: policy {policy} at world size {w} has no data-parallel axis to shard over; "
                    f"use --policy dp (or hybrid at W>=4), or --replicas 2")
    return None


def rank_memory(answers) -> list | None:
    """The measured memory of each rank's answer (``verify/cases/memory.py``), by rank; None if none."""
    out = [a.result.get("memory") if a.result else None for a in sorted(answers, key=lambda a: a.rank)]
    return out if any(out) else None
