"""Which program of a mismatching whole-model row to localise, chosen by its first failing check: the
case's own plan (a pipeline stage by stage, replicas on their plan's ranks), or the plan its
checkpoint resumed under (``resumed under tp at W=2: grad ...``, ``loss of the checkpoint under dp``),
so a row is attributed to the program that diverged."""
from __future__ import annotations

import re

import torch.distributed as dist

from nnscaler.recipe import Recipe

from verify.localize.model import Localized, localize_model_case
from verify.localize.stages import localize_pipeline_case, localize_replicas_case
from verify.cases.pipeline import is_pipeline_policy

_RESUMED = re.compile(r"^resumed under (\S+)(?: zero\d)? at W=(\d+): (loss|grad) ")  # ZeRO: localised without it
_RELOADED = re.compile(r"^loss of the checkpoint under (\S+)$")


def diverged_plan(check: str, world_size: int) -> tuple[str, int] | None:
    """``(policy, world size)`` of the other plan a failing check ``check`` judged (the plan a
    checkpoint was resumed and trained under, or reloaded under), or ``None`` for the case's own."""
    found = _RESUMED.match(check)
    if found:
        return found.group(1), int(found.group(2))
    found = _RELOADED.match(check)
    return (found.group(1), world_size) if found else None


def localize_row(job: dict, first_failure: str, groups) -> Localized | None:
    """Localise a mismatching model job (every rank of the case calls this; ``None`` on ranks that
    take no part): ``first_failure`` is the name of its first failing check."""
    name, policy, w, seed, gen, dtype = (job["model"], job["policy"], job["world_size"], job["seed"], job["gen_dir"],
                                         job.get("dtype", "float32"))
    other = diverged_plan(first_failure, w)
    if other is not None and not is_pipeline_policy(other[0]):
        plan, w_b = other
        if dist.get_rank() >= w_b:
            return None
        found = localize_model_case(name, plan, w_b, seed, groups, gen, dtype=dtype, plan_seed=seed + 1,
                                    failing=first_failure)
        if found.found is not None:
            found.found.where = f"plan {plan} at W={w_b}, where the checkpoint was resumed"
        else:
            found.note = f"plan {plan} at W={w_b} (where the checkpoint was resumed): {found.note}"
        return found
    microbatches = Recipe.from_dict(job.get("recipe")).num_microbatches
    if job.get("plan_ngpus", w) < w:
        return localize_replicas_case(name, policy, w, job["plan_ngpus"], seed, groups, gen, dtype, microbatches,
                                      failing=first_failure)
    if is_pipeline_policy(policy):
        return localize_pipeline_case(name, policy, w, seed, groups, gen, dtype, microbatches)
    return localize_model_case(name, policy, w, seed, groups, gen, dtype=dtype, failing=first_failure)
