"""The sweep: cases (operator x partition x world size x seed; models x policy) run on a :class:`Gang`
and judged into rows."""
from __future__ import annotations

import inspect
import math
import time
from dataclasses import replace
from typing import Iterator

from nnscaler.ops.spec import OpSpec

from verify.config import BadInput, RunConfig, model_label, rerun_modules

from verify.judge.row import Row
from verify.kinds.model import Model
from verify.kinds.op import Op
from verify.cases.model import expected_checks
from verify.cases.pipeline import pipeline_applies, pipeline_microbatches
from verify.cases.zero import rank_memory, zero_applies
from verify.judge.verdict import MATCH, judge, localization, worst
from verify.runner.gang import Gang


def plan_op(gang: Gang, spec: OpSpec, cfg: RunConfig, seed: int) -> tuple[dict[int, list[str]] | None, Row | None]:
    """The partitions to run per world size (computed on rank 0), or an error row for the op."""
    job = {"kind": "op_partitions", **cfg.job(spec), "dtype": cfg.dtype, "seed": seed, "base": cfg.base,
           "world_sizes": list(cfg.world_sizes), "partition": cfg.partition}
    (answer,) = gang.run(job, 1, cfg.timeout_s)
    call_error = answer.result and answer.result.get("error_type") == "TypeError" and \
        "(at samples.py:" in answer.result.get("error", "")  # the op cannot be called with its annotated inputs
    if answer.result and (answer.result.get("error_type") == "AnnotationError" or call_error):  # spec vs op
        raise BadInput(f"op {spec.name!r} `{spec.annotation}`: "
                       + answer.result["error"].split(" (at ")[0].removeprefix("AnnotationError: ")
                       + ("; the annotation must name one input per argument" if call_error else ""))
    if answer.failure or answer.result.get("error"):
        status, detail, _, tb = judge([answer])
        return None, Row(cfg.row_name(spec), spec.family, spec.annotation, 0, "sampling", cfg.dtype, seed, status,
                         detail=f"sampling failed: {detail}", rerun=Op.rerun_command(cfg, spec.name, max(cfg.world_sizes), "replicate", seed),
                         traceback=tb)
    empty = sorted(k for k, n in answer.result["sizes"].items() if n == 0)
    if empty:
        raise BadInput(f"op {spec.name!r} `{spec.annotation}`: zero-length dimension {', '.join(empty)}; "
                       f"give it a positive length (sizes=...)")
    return {int(w): labels for w, labels in answer.result["plans"].items()}, None


def check_spec(spec: OpSpec) -> None:
    """Raise :class:`BadInput` for what is wrong with a spec without running it: an annotation whose
    input count the function cannot take, a negative tolerance, a zero or negative fixed length."""
    n = len(spec.anno.inputs)
    try:
        inspect.signature(spec.fn).bind(*range(n), **dict(spec.kwargs))
    except TypeError as exc:
        raise BadInput(f"op {spec.name!r}: the annotation `{spec.annotation}` names {n} inputs, but its function "
                       f"cannot be called so: {exc}") from None
    except ValueError:
        pass  # a builtin without a signature: its call is checked on the first sample
    tol = spec.tolerance
    for name in ("factor", "floor_eps"):
        v = getattr(tol, name, None) if tol is not None else None
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise BadInput(f"op {spec.name!r}: tolerance {name}={v!r} must be a finite number >= 0")
    for k, v in spec.sizes.items():
        if not (isinstance(v, int) and v > 0):
            raise BadInput(f"op {spec.name!r}: sizes[{k!r}] = {v!r}; lengths must be positive integers")


def preflight(gang: Gang, specs, cfg: RunConfig, planned: dict | None = None) -> None:
    """Check every spec, and sample each once on rank 0, before any case runs: bad input
    (:class:`BadInput`) is found before work starts, not as failing rows halfway through. The
    answers go into ``planned`` (by spec name, for the first seed), for :func:`run_op` to reuse."""
    for spec in specs:
        check_spec(spec)
    for spec in specs:
        answer = plan_op(gang, spec, cfg, cfg.seeds[0])
        if planned is not None:
            planned[spec.name] = answer


def run_op(gang: Gang, spec: OpSpec, cfg: RunConfig, skip: frozenset | set = frozenset(),
           planned: dict | None = None) -> Iterator[Row]:
    """Verify ``spec`` under every partition, world size and seed of ``cfg``; yield rows as they
    finish, leaving out cases whose :attr:`Row.key` is in ``skip`` (already done). ``planned``:
    :func:`preflight`'s answers for the first seed (not asked again)."""
    for seed in cfg.seeds:
        known = (planned or {}).pop(spec.name, None) if seed == cfg.seeds[0] else None
        plans, failed = known if known is not None else plan_op(gang, spec, cfg, seed)
        if failed:
            yield failed
            continue
        name = cfg.row_name(spec)
        for w in cfg.world_sizes:
            for label in plans[w]:
                if (name, w, label, cfg.dtype, seed) in skip:
                    continue
                start = time.perf_counter()
                job = {"kind": "op", **cfg.job(spec), "dtype": cfg.dtype, "seed": seed, "base": cfg.base,
                       "world_size": w, "partition": label}
                status, detail, checks, tb = judge(gang.run(job, w, cfg.limit_s("op")))
                out, grad = worst(checks, "output"), worst(checks, "grad")
                yield Row(name, spec.family, spec.annotation, w, label, cfg.dtype, seed, status,
                          out and out["err"], out and out["tol"], grad and grad["err"], grad and grad["tol"],
                          detail, "" if status == MATCH else Op.rerun_command(cfg, spec.name, w, label, seed),
                          time.perf_counter() - start, tb)




def run_model(gang: Gang, name: str, policies: tuple[str, ...], cfg: RunConfig, gen_dir: str, steps: int = 3,
              skip: frozenset | set = frozenset(), bucket_bytes: int | None = None,
              checkpoint: bool = True, used=None) -> Iterator[Row]:
    """Train model ``name`` under each policy (a built-in name or ``FILE.py:fn``), world size and seed
    of ``cfg`` in ``cfg.dtype``; one row per case, judged on the loss and every gradient at the
    single-device parameters, every optimizer update, and the reloaded checkpoint (``verify/judge/compare.py``).
    ``bucket_bytes`` sets the gradient-sync bucket size of the compiled modules. With
    ``cfg.microbatches`` M above 1, each step trains M stacked batches by ``train_step`` in M
    micro-batches (against one device on the whole batch); the row's partition reads ``POLICY mbM``.
    ``checkpoint=False`` judges the training steps alone (no checkpoint reloads, no resume).
    ``used`` (a :class:`verify.sweep.cache.Used`) collects what the ranks ran, for the verdict cache."""
    for seed in cfg.seeds:
        for w in cfg.world_sizes:
            for policy in policies:
                m = pipeline_microbatches(policy, cfg.microbatches)  # a pipeline runs 4 unless told more
                label = model_label(policy, replace(cfg.recipe, num_microbatches=m))
                if (f"model:{name}", w, label, cfg.dtype, seed) in skip or not pipeline_applies(policy, w, name, seed) \
                        or (cfg.zero and not zero_applies(policy, w, zero=cfg.zero)):
                    continue
                start = time.perf_counter()
                job = {"kind": "model", "model": name, "policy": policy, "world_size": w, "steps": steps,
                       "seed": seed, "gen_dir": gen_dir, "dtype": cfg.dtype, "checkpoint": checkpoint,
                       **cfg.recipe_job(m, bucket_bytes)}
                expected = expected_checks(name, policy, steps, seed, checkpoint, recipe=cfg.recipe)
                answers = gang.run(job, w, replace(cfg, microbatches=m).limit_s("model", steps))
                if used is not None:
                    used.add(answers)
                status, detail, checks, tb = judge(answers, expected,
                                                   rerun_modules(name, cfg))
                out = worst([c for c in checks if not c["name"].startswith("grad")], "")
                grad = worst(checks, "grad")
                rerun = Model.rerun_command(cfg, name, policy, w, seed, steps, bucket_bytes)
                what = f"{steps} AdamW steps vs one device" if m == 1 else \
                    f"{steps} AdamW steps of {m} micro-batches vs one device on the whole batch"
                yield Row(f"model:{name}", "model", what, w, label, cfg.dtype, seed, status,
                          out and out["err"], out and out["tol"], grad and grad["err"], grad and grad["tol"],
                          detail, "" if status == MATCH else rerun, time.perf_counter() - start, tb, m,
                          rank_memory(answers),
                          None if status == MATCH else localization(answers, rerun_modules(name, cfg)))


