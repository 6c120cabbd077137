"""Rows of replicas cases, driven on a :class:`Gang`: a plan on ``W / R`` ranks run as ``R``
data-parallel replicas on W ranks (``verify model --replicas R``; ``verify all`` runs a ``tp`` plan
times :data:`ALL_REPLICAS` for every model, and the ``pp`` pipeline for the pipeline models). The
ranks' part is :mod:`verify.cases.replicas`."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Iterator, Sequence

from verify.judge.verdict import MATCH, localization, worst as _worst, judge

from verify.config import RunConfig, model_label, rerun_modules

from verify.judge.row import Row
from verify.kinds.model import Model
from verify.runner.gang import Gang
from verify.cases.zero import rank_memory, zero_applies
from verify.cases.pipeline import PIPELINE_MODELS, pipeline_applies, pipeline_microbatches
from verify.cases.replicas import expected_replica_checks, replica_label

ALL_REPLICAS = 2  # verify all: each model's tp plan on W/2 ranks, run as 2 replicas at every W >= 4


def replica_world_sizes(world_sizes: Sequence[int], replicas: int = ALL_REPLICAS) -> tuple[int, ...]:
    """The world sizes ``verify all`` runs replicas at: a plan of at least 2 ranks, times ``replicas``."""
    return tuple(w for w in world_sizes if w >= 2 * replicas and w % replicas == 0)


def replica_items(models: Sequence[str], world_sizes: Sequence[int]) -> list[tuple[str, tuple]]:
    """``verify all``'s replicas items: ``(label, (model, policy, ALL_REPLICAS, world sizes))``: ``tp`` for
    every model and the ``pp`` pipeline for the pipeline models, where a world size allows (none otherwise)."""
    sizes = replica_world_sizes(world_sizes)
    if not sizes:
        return []
    pairs = [(m, "tp") for m in models] + [(m, "pp") for m in models if m in PIPELINE_MODELS]
    return [(f"model:{m} {replica_label(p, ALL_REPLICAS)}", (m, p, ALL_REPLICAS, sizes)) for m, p in pairs]


REPLICA_BUCKET_BYTES = 4096  # replica rows sync gradients in buckets this small unless told otherwise


def run_replicas(gang: Gang, name: str, policies: tuple[str, ...], cfg: RunConfig, gen_dir: str, replicas: int,
                 steps: int = 3, skip: frozenset | set = frozenset(), bucket_bytes: int | None = None,
                 used=None) -> Iterator[Row]:
    """Model ``name`` planned by each policy on ``W / replicas`` ranks and run as ``replicas``
    data-parallel replicas on W ranks, for each world size W of ``cfg`` (a multiple of ``replicas``),
    seed and ``cfg.dtype``: one row per case, judged against one device (``verify/cases/replicas.py``),
    with ``cfg.microbatches`` micro-batches per step and gradient-sync buckets of ``bucket_bytes``
    (default :data:`REPLICA_BUCKET_BYTES`: many small buckets, where a race between a bucket's
    averaging over replicas and the next backward shows; one large bucket hides it)."""
    bucket_bytes = REPLICA_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    for seed in cfg.seeds:
        for w in cfg.world_sizes:
            for policy in policies:
                label = model_label(policy, cfg.recipe, replicas)
                if ((f"model:{name}", w, label, cfg.dtype, seed) in skip
                        or not pipeline_applies(policy, w // replicas, name, seed)
                        or (cfg.zero and not zero_applies(policy, w // replicas, replicas, cfg.zero))):
                    continue
                start = time.perf_counter()
                m = pipeline_microbatches(policy, cfg.microbatches)  # a pipeline runs 4 unless told more
                job = {"kind": "model", "model": name, "policy": policy, "world_size": w, "plan_ngpus": w // replicas,
                       "steps": steps, "seed": seed, "gen_dir": gen_dir, "dtype": cfg.dtype,
                       **cfg.recipe_job(m, bucket_bytes)}
                limit = replace(cfg, microbatches=m).limit_s("model", steps)
                expected = expected_replica_checks(name, steps, seed, policy, m)
                answers = gang.run(job, w, limit)
                if used is not None:  # what the ranks ran, for the verdict cache (verify/sweep/cache.py)
                    used.add(answers)
                status, detail, checks, tb = judge(answers, expected, rerun_modules(name, cfg))
                out = _worst([c for c in checks if not c["name"].startswith("grad")], "")
                grad = _worst(checks, "grad")
                rerun = Model.rerun_command(cfg, name, policy, w, seed, steps, bucket_bytes, replicas)
                what = f"{steps} AdamW steps vs one device" if m == 1 else \
                    f"{steps} AdamW steps of {m} micro-batches per replica vs one device on the whole batch"
                yield Row(f"model:{name}", "model", what, w, label, cfg.dtype, seed,
                          status, out and out["err"], out and out["tol"], grad and grad["err"], grad and grad["tol"],
                          detail, "" if status == MATCH else rerun, time.perf_counter() - start, tb, m,
                          rank_memory(answers),
                          None if status == MATCH else localization(answers, rerun_modules(name, cfg)))
