"""Cases (operator x partition x world size x seed) and their verdicts, driven on a :class:`Gang`."""
from __future__ import annotations

import inspect
import math
import shlex
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Iterator, Sequence

from nnscaler.ops.spec import OpSpec

from .gang import Gang, RankAnswer
from .localize import Divergence
from .model_case import expected_checks
from .pipeline_case import pipeline_applies, pipeline_microbatches
from .samples import split_base

MATCH, MISMATCH, ERROR, TIMEOUT, CRASH = "match", "MISMATCH", "error", "timeout", "crash"
UNVERIFIABLE = "unverifiable"  # a random operator: never a match, never a mismatch


MODEL_LIMIT_FACTOR = 8  # a model case traces, compiles, trains and reloads: far more than one operator


class BadInput(ValueError):
    """The user asked for something that does not exist (an unknown partition, say): exit code 2."""


@dataclass(frozen=True)
class RunConfig:
    """Settings of one verification run, passed explicitly to every stage."""

    world_sizes: tuple[int, ...] = (2, 4)
    dtype: str = "float32"
    seeds: tuple[int, ...] = (0,)
    modules: tuple[str, ...] = ()
    timeout_s: float = 30.0
    partition: str | None = None
    base_override: int | None = None
    microbatches: int = 1  # whole-model cases: micro-batches per training step (1: plain forward/backward)
    node: tuple[str, str] | None = None  # (model, operator): verify that traced operator (verify op --model --node)

    def limit_s(self, kind: str = "op", steps: int = 1) -> float:
        """The time limit of one case: ``timeout_s`` for an operator case; a model case traces,
        compiles, trains ``steps`` steps on three copies and reloads its checkpoint twice, so it gets
        ``MODEL_LIMIT_FACTOR`` times that, growing with the steps beyond three and with the
        micro-batches beyond two (each step then runs that many forward and backward passes)."""
        if kind == "model":
            return self.timeout_s * MODEL_LIMIT_FACTOR * max(1.0, steps / 3) * max(1.0, self.microbatches / 2)
        return self.timeout_s

    @property
    def base(self) -> int:
        """Splittable lengths are multiples of this (the lcm of the world sizes unless overridden)."""
        return self.base_override or split_base(self.world_sizes)

    def job(self, spec: OpSpec) -> dict:
        """What names the operator in a rank job: a registered name, or a model's traced node."""
        if self.node is None:
            return {"op": spec.name}
        return {"op": self.node[1], "model": self.node[0]}

    def row_name(self, spec: OpSpec) -> str:
        """The op column of a row: the registered name, or ``MODEL:NODE``."""
        return spec.name if self.node is None else f"{self.node[0]}:{self.node[1]}"

    def command(self, kind: str, name: str | None, flags: Sequence[tuple[str, object]]) -> str:
        """The one place a rerun command is assembled: ``python -m verify KIND NAME`` (no ``NAME`` when
        ``None``) with ``flags`` in order (a ``None`` value leaves its flag out), then this run's
        ``--module`` files. A setting that decides a row is one more ``(flag, value)`` pair in
        :meth:`rerun` or :meth:`rerun_model`."""
        parts = ["python", "-m", "verify", kind] + ([] if name is None else [name])
        for flag, value in flags:
            if value is not None:
                parts += [flag, str(value)]
        for m in self.modules:
            parts += ["--module", m]
        return " ".join(shlex.quote(p) for p in parts)

    def rerun(self, op: str, world_size: int, partition: str, seed: int) -> str:
        """The command that reruns one row alone (an operator of a model: ``--model M --node N``)."""
        if self.node is not None:
            return self.command("op", None, [
                ("--model", self.node[0]), ("--node", self.node[1]), ("--world-size", world_size),
                ("--partition", partition), ("--seed", seed), ("--dtype", self.dtype)])
        return self.command("op", op, [
            ("--world-size", world_size), ("--partition", partition), ("--seed", seed), ("--dtype", self.dtype),
            ("--base", None if split_base([world_size]) == self.base else self.base)])

    def rerun_model(self, model: str, policy: str, world_size: int, seed: int, steps: int,
                    bucket_bytes: int | None = None) -> str:
        """The command that reruns one whole-model row alone (same modules, dtype, steps, buckets, micro-batches)."""
        return self.command("model", model, [
            ("--policy", policy), ("--world-size", world_size), ("--seed", seed), ("--steps", steps),
            ("--dtype", self.dtype), ("--bucket-bytes", bucket_bytes),
            ("--microbatches", self.microbatches if self.microbatches > 1 else None)])


@dataclass
class Row:
    """The verdict of one case."""

    op: str
    family: str
    annotation: str
    world_size: int
    partition: str
    dtype: str
    seed: int
    status: str
    out_err: float | None = None
    out_tol: float | None = None
    grad_err: float | None = None
    grad_tol: float | None = None
    detail: str = ""
    rerun: str = ""
    seconds: float = 0.0
    traceback: str = field(default="", repr=False)
    microbatches: int = 1  # whole-model rows: micro-batches per step (the partition label says so too)

    @property
    def ok(self) -> bool:
        return self.status == MATCH

    @property
    def case_label(self) -> str:
        """``W=2 [m=2]``; ``sampling`` for the row of an op whose sample could not be made (no world size)."""
        return f"W={self.world_size} [{self.partition}]" if self.world_size else "sampling"

    @property
    def key(self) -> tuple:
        return (self.op, self.world_size, self.partition, self.dtype, self.seed)

    def to_json(self) -> dict:
        return asdict(self)


def _worst(checks: list[dict], kind: str) -> dict | None:
    mine = [c for c in checks if c["name"].startswith(kind)]
    if not mine:
        return None

    def ratio(c):
        if not c["ok"]:
            return float("inf")
        return c["err"] / c["tol"] if c["tol"] > 0 else 0.0

    return max(mine, key=ratio)


def judge(answers: list[RankAnswer], expected: list[str] | None = None, modules=()
          ) -> tuple[str, str, list[dict], str]:
    """Status, detail, merged checks (worst rank per tensor) and a traceback from per-rank answers.

    A dead rank (crash, memory cap) outranks everything; then a rank's own exception, with its
    traceback, whatever its peers did (a peer stuck in a collective after the error is a consequence);
    a timeout only when no rank raised and the limit truly passed. A rank that returns no checks, or
    (given ``expected``) lacks any expected check, fails the case. A mismatching model case names its
    first divergent operator (``modules``: the files that operator's rerun command needs)."""
    for kinds, status in ((("crash", "memory"), CRASH),):
        dead = [a for a in answers if a.failure and a.kind in kinds]
        if dead:
            return status, dead[0].failure, [], ""
    errors = [a for a in answers if a.result and a.result.get("error")]
    if errors:  # every rank's own reason (a failing pipeline stage names each rank that raised)
        a = errors[0]
        same = [b.rank for b in errors[1:] if b.result["error"] == a.result["error"]]
        other = "".join(f"; rank {b.rank}: {b.result['error']}" for b in errors[1:]
                        if b.result["error"] != a.result["error"])
        peers = sorted(b.rank for b in answers if b.failure)
        note = f" (ranks {peers} then gave no answer)" if peers else ""
        also = f"; the same on ranks {same}" if same else ""
        return ERROR, f"rank {a.rank}: {a.result['error']}{also}{other}{note}", [], a.result.get("traceback", "")
    late = [a for a in answers if a.failure]
    if late:
        more = f" (and ranks {[b.rank for b in late[1:]]})" if len(late) > 1 else ""
        return TIMEOUT, late[0].failure + more, [], ""
    unverifiable = next((a.result["unverifiable"] for a in answers if a.result.get("unverifiable")), None)
    if unverifiable:
        return UNVERIFIABLE, unverifiable, [], ""
    merged: dict[str, dict] = {}
    order: list[str] = []
    short = ""
    for a in answers:
        names = {c["name"] for c in a.result.get("checks", [])}
        if not names:
            return MISMATCH, f"rank {a.rank} returned no checks", [], ""
        lacking = [n for n in expected or () if n not in names]
        if lacking and not short:
            short = f"rank {a.rank} returned {len(names)} checks and lacks {len(lacking)}: {', '.join(lacking[:3])}"
        for c in a.result["checks"]:
            c = dict(c, rank=a.rank)
            if c["name"] not in merged:
                order.append(c["name"])
                merged[c["name"]] = c
            else:
                old = merged[c["name"]]
                if (not c["ok"] and old["ok"]) or (c["ok"] == old["ok"] and c["err"] > old["err"]):
                    merged[c["name"]] = c
    checks = [merged[n] for n in order]
    bad = next((c for c in checks if not c["ok"]), None)
    if bad:
        detail = f"{bad['name']} on rank {bad['rank']}: {bad['reason']}"
        where = answers[0].result.get("divergence")
        if where:
            detail += "; " + Divergence(**where).describe(modules)
        elif answers[0].result.get("divergence_note"):
            detail += "; " + answers[0].result["divergence_note"]
        elif answers[0].result.get("divergence_error"):
            detail += f"; no operator localised ({answers[0].result['divergence_error']})"
        return MISMATCH, detail, checks, ""
    if short:
        return MISMATCH, short, checks, ""
    return MATCH, "", checks, ""


def plan_op(gang: Gang, spec: OpSpec, cfg: RunConfig, seed: int) -> tuple[dict[int, list[str]] | None, Row | None]:
    """The partitions to run per world size (computed on rank 0), or an error row for the op."""
    job = {"kind": "plan", **cfg.job(spec), "dtype": cfg.dtype, "seed": seed, "base": cfg.base,
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
                         detail=f"sampling failed: {detail}", rerun=cfg.rerun(spec.name, max(cfg.world_sizes), "replicate", seed),
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


def preflight(gang: Gang, specs, cfg: RunConfig) -> None:
    """Check every spec, and sample each once on rank 0, before any case runs: bad input
    (:class:`BadInput`) is found before work starts, not as failing rows halfway through."""
    for spec in specs:
        check_spec(spec)
    for spec in specs:
        plan_op(gang, spec, cfg, cfg.seeds[0])


def run_op(gang: Gang, spec: OpSpec, cfg: RunConfig, skip: frozenset | set = frozenset()) -> Iterator[Row]:
    """Verify ``spec`` under every partition, world size and seed of ``cfg``; yield rows as they
    finish, leaving out cases whose :attr:`Row.key` is in ``skip`` (already done)."""
    for seed in cfg.seeds:
        plans, failed = plan_op(gang, spec, cfg, seed)
        if failed:
            yield failed
            continue
        name = cfg.row_name(spec)
        for w in cfg.world_sizes:
            for label in plans[w]:
                if (name, w, label, cfg.dtype, seed) in skip:
                    continue
                start = time.perf_counter()
                job = {"kind": "case", **cfg.job(spec), "dtype": cfg.dtype, "seed": seed, "base": cfg.base,
                       "world_size": w, "partition": label}
                status, detail, checks, tb = judge(gang.run(job, w, cfg.limit_s("op")))
                out, grad = _worst(checks, "output"), _worst(checks, "grad")
                yield Row(name, spec.family, spec.annotation, w, label, cfg.dtype, seed, status,
                          out and out["err"], out and out["tol"], grad and grad["err"], grad and grad["tol"],
                          detail, "" if status == MATCH else cfg.rerun(spec.name, w, label, seed),
                          time.perf_counter() - start, tb)




def run_model(gang: Gang, name: str, policies: tuple[str, ...], cfg: RunConfig, gen_dir: str, steps: int = 3,
              skip: frozenset | set = frozenset(), bucket_bytes: int | None = None,
              checkpoint: bool = True) -> Iterator[Row]:
    """Train model ``name`` under each policy (a built-in name or ``FILE.py:fn``), world size and seed
    of ``cfg`` in ``cfg.dtype``; one row per case, judged on the loss and every gradient at the
    single-device parameters, every optimizer update, and the reloaded checkpoint (``verify/compare.py``).
    ``bucket_bytes`` sets the gradient-sync bucket size of the compiled modules. With
    ``cfg.microbatches`` M above 1, each step trains M stacked batches by ``train_step`` in M
    micro-batches (against one device on the whole batch); the row's partition reads ``POLICY mbM``.
    ``checkpoint=False`` judges the training steps alone (no checkpoint reloads, no resume)."""
    for seed in cfg.seeds:
        for w in cfg.world_sizes:
            for policy in policies:
                m = pipeline_microbatches(policy, cfg.microbatches)  # a pipeline runs 4 unless told more
                label = model_label(policy, m)
                if (f"model:{name}", w, label, cfg.dtype, seed) in skip or not pipeline_applies(policy, w, name, seed):
                    continue
                start = time.perf_counter()
                job = {"kind": "model", "model": name, "policy": policy, "world_size": w, "steps": steps,
                       "seed": seed, "gen_dir": gen_dir, "dtype": cfg.dtype, "bucket_bytes": bucket_bytes,
                       "microbatches": m, "checkpoint": checkpoint}
                expected = expected_checks(name, policy, steps, seed, checkpoint)
                status, detail, checks, tb = judge(gang.run(job, w, replace(cfg, microbatches=m).limit_s("model", steps)), expected,
                                                   cfg.modules)
                out = _worst([c for c in checks if not c["name"].startswith("grad")], "")
                grad = _worst(checks, "grad")
                rerun = cfg.rerun_model(name, policy, w, seed, steps, bucket_bytes)
                what = f"{steps} AdamW steps vs one device" if m == 1 else \
                    f"{steps} AdamW steps of {m} micro-batches vs one device on the whole batch"
                yield Row(f"model:{name}", "model", what, w, label, cfg.dtype, seed, status,
                          out and out["err"], out and out["tol"], grad and grad["err"], grad and grad["tol"],
                          detail, "" if status == MATCH else rerun, time.perf_counter() - start, tb, m)


def model_label(policy: str, microbatches: int = 1) -> str:
    """The partition column of a whole-model row: the policy, then ``mbM`` for M micro-batches."""
    return policy if microbatches == 1 else f"{policy} mb{microbatches}"
