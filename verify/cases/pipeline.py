"""Pipeline policies in the whole-model harness: which apply at a world size, and the bad input a
pipeline case is refused for before any rank starts (too few layers, a batch that does not divide
into micro-batches)."""
from __future__ import annotations

import functools

from nnscaler.policies.cut import check_model, cut_units
from nnscaler.policies.pipeline import PIPELINE_POLICIES, is_pipeline_policy
from nnscaler.config import n_stages
from nnscaler.policies.pipeline import pipeline_config
from nnscaler.policies.pipeline import SWEPT, applies
from nnscaler.policies import ComputeConfig, PlanError

from verify.cases.microbatch import whole_batch
from verify.models.loader import build_model
from verify.models.registry import ModelCase

__all__ = ["PIPELINE_MICROBATCHES", "PIPELINE_MODELS", "PIPELINE_POLICIES", "SWEPT", "check_pipeline_input", "is_pipeline_policy", "pipeline_applies",
           "pipeline_microbatches"]


PIPELINE_MODELS = ("nanogpt", "llama", "gpt2", "bert", "transformer_encoder")  # swept under SWEPT by verify all
PIPELINE_MICROBATCHES = 4  # micro-batches of a pipeline case unless --microbatches asks for more


def pipeline_microbatches(policy: str, microbatches: int) -> int:
    """The micro-batches of a whole-model case: at least :data:`PIPELINE_MICROBATCHES` under a pipeline."""
    return max(microbatches, PIPELINE_MICROBATCHES) if is_pipeline_policy(policy) else microbatches


def pipeline_applies(policy: str, world_size: int, name: str | None = None, seed: int = 0) -> bool:
    """False for a pipeline policy that does not run at ``world_size`` (pp2_* at W=2), or, given model
    ``name``, that needs more stages than the model has layers (``pp_interleaved`` at W=8 on a
    12-layer model); True otherwise."""
    if not is_pipeline_policy(policy):
        return True
    return applies(policy, world_size) and (name is None or _fits(name, seed, policy, world_size))


@functools.lru_cache(maxsize=64)
def _layers(name: str, seed: int) -> int:
    return len(cut_units(build_model(name, seed).model))


def _fits(name: str, seed: int, policy: str, world_size: int, layers: int | None = None) -> bool:
    layers = _layers(name, seed) if layers is None else layers
    return n_stages(pipeline_config(policy, ComputeConfig(world_size))[1]) <= layers


def check_pipeline_input(name: str, policies, world_sizes, microbatches: int = 1, seed: int = 0,
                         replicas: int = 1, case: ModelCase | None = None) -> None:
    """Raise ``PlanError`` (one line) for a pipeline policy that cannot run on model ``name`` at any
    of ``world_sizes`` it applies to (with ``replicas``, the pipeline is planned on ``W / replicas``
    ranks)."""
    wanted = [p for p in policies if is_pipeline_policy(p)]
    if not wanted:
        return
    case = build_model(name, seed) if case is None else case  # the caller's inspection build, when it has one
    layers = len(cut_units(case.model))
    plans = [w // replicas for w in world_sizes if w % replicas == 0]
    for policy in wanted:
        fit = [p for p in plans if applies(policy, p) and _fits(name, seed, policy, p, layers)]
        if not fit and any(applies(policy, p) for p in plans):  # too few layers wherever it applies: say so
            fit = [next(p for p in plans if applies(policy, p))]
        if not any(applies(policy, p) for p in plans):
            need = 2 * (PIPELINE_POLICIES[policy].pp_size or 1)
            raise PlanError(f"pipeline policy {policy} runs at none of the world sizes {list(world_sizes)}"
                            + (f" with {replicas} replicas" if replicas > 1 else "") + ": "
                            f"{PIPELINE_POLICIES[policy].pp_size or 'world'} stages of several ranks each need "
                            f"{'a plan' if replicas > 1 else 'a world size'} of {need} or more ranks")
        for p in fit:  # a world size whose stages outnumber the layers is skipped when another fits
            if applies(policy, p):
                m = pipeline_microbatches(policy, microbatches)
                _, config = pipeline_config(policy, ComputeConfig(p, runtime_ngpus=p * replicas, num_microbatches=m))
                check_model(case.model, whole_batch(case.batch, 0, m), config)
