"""``plan_cluster``: the outer configuration of a real training run, searched jointly on the cluster cost
model (:mod:`nnscaler.cluster.cost`): tensor parallelism (with or without sequence parallelism),
pipeline stages (1F1B, or interleaved with virtual stages), micro-batch size and count, data
parallelism with a ZeRO stage, context parallelism (degree and scheme: all-gather, ring or Ulysses's all-to-all where the heads divide)
and recompute.

The model is traced once on the meta device, two of its blocks (:mod:`.trace`), and read as
repeated blocks (:mod:`nnscaler.cluster.blocks`);
one block is costed per (tp, sequence parallelism, micro-batch size, recompute, cp) and the rest of the
space is enumerated analytically, so a 126-layer model plans in about the time of its trace.

How this relates to ``autodist``: the cluster search picks the outer configuration (the mesh of tp x
pp x dp, the schedule, the recipes). Inside a stage every operator is partitioned by Megatron-LM's
rule (``tp``: column then row, attention by heads, vocabulary-parallel embedding and loss), which is
what the block costs assume. The per-operator integer program (``autodist``) stays the planner for
one stage on few ranks, where a model is small enough that per-operator choices pay and its graph
small enough to solve; on a cluster its choices inside a tp group of 8 are Megatron's for every
transformer block we traced.

``ComputeConfig(constraints={...})`` fixes any subset of :data:`KEYS`; fixing all of them evaluates exactly
that configuration. Infeasible constraints are one :class:`PlanError` line naming the constraint and the
nearest feasible value.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..config import CONSTRAINT_KEYS as KEYS, CP_SCHEMES, RECOMPUTE_CHOICES as RECOMPUTES, ComputeConfig, PlanError
from ..cost.summary import human, seconds
from ..profiles import get_profile
from .blocks import ModelShape
from .cost import Estimate, Parallel, estimate, ulysses_fits
from .evidence import claims
from .plan import FORMAT, architecture_of, lower, lowered_dict
from .trace import trace_shape

MAX_MICRO_BATCH = 16
# the search splits a sequence no finer than this many tokens per cp rank: the shortest attention the cost model's
# ``attention`` constant was measured on (bench/results/h100_kernels.csv: 4096 and 8192 tokens); shorter blocks
# would price attention by a constant measured elsewhere. A ``cp`` constraint may still ask for more.
MIN_CP_TOKENS = 4096
MAX_VIRTUAL = 8


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest(value: int, ok: Sequence[int]) -> str:
    if not ok:
        return "none"
    best = sorted(ok, key=lambda x: (abs(x - value), x))
    return " or ".join(str(x) for x in sorted(best[:2])) if len(best) > 1 and abs(best[0] - value) == abs(
        best[1] - value) else str(best[0])


@dataclass
class ClusterPlan:
    """The chosen outer configuration, its estimate, and what the search looked at."""

    model: str
    world: int
    profile: str
    precision: str
    global_batch: int
    shape: ModelShape = field(repr=False)
    best: Estimate
    considered: int
    feasible: int
    seconds: float
    constraints: dict
    architecture: dict | None = None  # the transformers model's class and config (plan.architecture_of)

    @property
    def parallel(self) -> Parallel:
        return self.best.parallel

    def summary(self) -> dict:
        """The plan as a dict: ``mfu``, ``parallel`` (chosen values and schedule), step time and memory
        per rank broken down (seconds, bytes)."""
        return {
            "policy": "cluster", "model": self.model, "world_size": self.world, "profile": self.profile,
            "precision": self.precision, "global_batch": self.global_batch, "seq": self.shape.seq,
            "blocks": self.shape.layers, "parameters": self.shape.params,
            "parallel": self.best.parallel.as_dict(), "mfu": self.best.mfu,
            "tokens_per_second": self.best.tokens_per_second,
            "step_time": dict(self.best.time), "memory_per_rank": dict(self.best.memory),
            "memory_budget": self.best.budget, "constraints": dict(self.constraints),
            "search": {"considered": self.considered, "feasible": self.feasible, "seconds": self.seconds},
        }

    def lower(self, **extra) -> tuple[str, ComputeConfig]:
        """The policy and config the compiler runs for this plan (:func:`~.plan.lower`)."""
        return lower(self.best.parallel, self.precision, **extra)

    def save(self, path: str | os.PathLike) -> Path:
        """Write :meth:`summary` as JSON (no pickle) with the file format, the model's ``architecture``
        and what the compiler runs (``lowered``); read back by :func:`.plan.load`. Returns the path."""
        p = Path(path)
        data = {"format": FORMAT, **self.summary(), "architecture": self.architecture,
                "lowered": lowered_dict(self.best.parallel, self.precision)}
        p.write_text(json.dumps(data, indent=1) + "\n")
        return p

    def one_line(self) -> str:
        p = self.best.parallel
        return (f"{self.model} on {self.world} x {self.profile}: tp {p.tp}{' +sp' if p.sequence_parallel else ''} x "
                f"{cp_label(p) + ' x ' if p.cp > 1 else ''}pp "
                f"{p.pp}{f' (v={p.virtual_stages})' if p.virtual_stages > 1 else ''} x dp {p.dp}, micro-batch "
                f"{p.micro_batch_size} x {p.num_microbatches}, zero {p.zero}, recompute {p.recompute}: step "
                f"{seconds(self.best.step_seconds)}, MFU {100 * self.best.mfu:.1f}%, peak "
                f"{human(self.best.memory['peak'])}/rank")

    def report(self) -> str:
        t, m = self.best.time, self.best.memory
        lines = [self.one_line(), f"model: {self.shape.describe()}",
                 "step time: " + ", ".join(f"{k} {seconds(v)}" for k, v in t.items()),
                 "memory per rank: " + ", ".join(f"{k} {human(v)}" for k, v in m.items())
                 + f" (budget {human(self.best.budget)})",
                 f"searched {self.considered} configurations ({self.feasible} fit) in {self.seconds:.2f} s",
                 *claims(self.profile, self.world, self.best.parallel, self.best.mfu)]
        return "\n".join(lines) + "\n"


def cp_degrees(shape: ModelShape, ranks: int, min_tokens: int = 1) -> list[int]:
    """The context-parallel degrees dividing ``ranks`` that split each sequence into ``2 cp`` equal chunks
    (the causally balanced layout: two chunks per rank) with at least ``min_tokens`` tokens per rank
    (Ulysses's degrees are further those dividing the heads, :func:`~.cost.ulysses_fits`)."""
    return [d for d in _divisors(ranks) if d == 1 or (shape.seq % (2 * d) == 0 and shape.seq // d >= min_tokens)]


def _check_fixed(shape: ModelShape, world: int, cons: dict, global_batch: int) -> None:
    """Constraints the model or the world rules out, each one line with the nearest feasible value."""
    tp = cons.get("tp")
    heads_ok = [d for d in _divisors(world) if shape.heads % d == 0 and shape.kv_heads % d == 0]
    if tp is not None and (shape.heads % tp or shape.kv_heads % tp or world % tp):
        raise PlanError(f"constraint tp={tp}: tp must divide the {shape.heads} attention heads, the {shape.kv_heads} "
                        f"key/value heads and the world size {world}; nearest feasible tp: {_nearest(tp, heads_ok)}")
    cp = cons.get("cp")
    if cp is not None and cp > 1:
        ok = cp_degrees(shape, world // (tp or 1))
        if world % (cp * (tp or 1)) or shape.seq % (2 * cp):
            raise PlanError(f"constraint cp={cp}: cp must divide the world size {world}"
                            f"{f' over tp={tp}' if tp else ''} and split the {shape.seq} tokens of a sequence into "
                            f"2 x cp equal chunks; nearest feasible cp: {_nearest(cp, ok)}")
    if cons.get("cp_scheme") == "ulysses" and cp and tp and not ulysses_fits(shape, tp, cp):
        ok = [d for d in _divisors(world // tp) if ulysses_fits(shape, tp, d)]
        raise PlanError(f"constraint cp={cp} with cp_scheme='ulysses': Ulysses splits the {shape.heads // tp} heads "
                        f"of each tp rank over cp, which must divide them; nearest feasible cp: {_nearest(cp, ok)}")
    cpn = cp or 1
    pp = cons.get("pp")
    if pp is not None:
        ok = [d for d in _divisors(world // ((tp or 1) * cpn)) if d <= shape.layers]
        if pp > shape.layers:
            raise PlanError(f"constraint pp={pp}: more pipeline stages than the model's {shape.layers} blocks; nearest "
                            f"feasible pp: {_nearest(pp, ok)}")
        if world % (pp * (tp or 1) * cpn):
            raise PlanError(f"constraint pp={pp}: pp x tp{' x cp' if cp else ''} ({pp * (tp or 1) * cpn}) must divide "
                            f"the world size {world}; nearest feasible pp: {_nearest(pp, ok)}")
    v = cons.get("virtual_stages")
    if v is not None and v > 1 and v * (pp or 1) > shape.layers:
        ok = [x for x in range(1, shape.layers + 1) if x * (pp or 1) <= shape.layers]
        raise PlanError(f"constraint virtual_stages={v}: pp x virtual_stages exceeds the {shape.layers} blocks; nearest "
                        f"feasible virtual_stages: {_nearest(v, ok)}")
    dp = cons.get("dp")
    if dp is not None:
        ok = [d for d in _divisors(world) if global_batch % d == 0]
        if world % dp or global_batch % dp:
            raise PlanError(f"constraint dp={dp}: dp must divide the world size {world} and the global batch "
                            f"{global_batch}; nearest feasible dp: {_nearest(dp, ok)}")
    if tp and pp and dp and tp * cpn * pp * dp != world:
        raise PlanError(f"constraints tp={tp} x cp={cpn} x pp={pp} x dp={dp} = {tp * cpn * pp * dp} ranks, but the world "
                        f"size is {world}; nearest feasible dp: "
                        f"{world // (tp * cpn * pp) if world % (tp * cpn * pp) == 0 else 'none'}")
    mbs = cons.get("micro_batch_size")
    if mbs is not None and dp is not None and (global_batch // dp) % mbs:
        ok = _divisors(global_batch // dp)
        raise PlanError(f"constraint micro_batch_size={mbs}: must divide the {global_batch // dp} sequences per dp rank; "
                        f"nearest feasible micro_batch_size: {_nearest(mbs, ok)}")


def candidates(shape: ModelShape, world: int, global_batch: int, cons: dict, ranks_per_node: int):
    """Every outer configuration the constraints allow (tp inside one node, dividing the heads; cp splitting
    each sequence into ``2 cp`` chunks of at least :data:`MIN_CP_TOKENS` tokens per rank, each scheme of
    :data:`~nnscaler.config.CP_SCHEMES`, causally balanced unless a constraint says otherwise: unbalanced
    chunks are never faster)."""
    tps = [cons["tp"]] if "tp" in cons else [d for d in _divisors(world) if d <= ranks_per_node
                                             and shape.heads % d == 0 and shape.kv_heads % d == 0]
    balanced = cons.get("cp_balanced", True)
    for tp in tps:
        cps = [cons["cp"]] if "cp" in cons else cp_degrees(shape, world // tp, MIN_CP_TOKENS)
        for cp in cps:
            yield from _candidates(shape, world, global_batch, cons, tp, cp, balanced)


def _candidates(shape: ModelShape, world: int, global_batch: int, cons: dict, tp: int, cp: int, balanced: bool):
    schemes = [cons["cp_scheme"]] if "cp_scheme" in cons else list(CP_SCHEMES) if cp > 1 else [CP_SCHEMES[0]]
    schemes = [x for x in schemes if x != "ulysses" or cp == 1 or ulysses_fits(shape, tp, cp)]  # heads over cp
    if world % (tp * cp) or not schemes:
        return
    # sequence parallelism with cp is priced only where a constraint asks for it: the compiler runs it over contiguous
    # chunks alone (nnscaler/policies/cp_mesh.py; balanced chunks and Ulysses refuse it, plan.cp_refusal), and its
    # memory there is not measured at real size (an 8B 128k plan priced with it peaked 12 GiB over while the cp
    # policies still ran it as no sp, bench/results/real_memory.md)
    sps = [cons["sequence_parallel"]] if "sequence_parallel" in cons else ([False, True] if tp > 1 and cp == 1
                                                                           else [False])
    pps = [cons["pp"]] if "pp" in cons else [d for d in _divisors(world // (tp * cp)) if d <= shape.layers]
    for pp in pps:
        if world % (tp * cp * pp):
            continue
        dp = world // (tp * cp * pp)
        if "dp" in cons and cons["dp"] != dp or global_batch % dp:
            continue
        per_dp = global_batch // dp
        mbss = [cons["micro_batch_size"]] if "micro_batch_size" in cons else \
            [d for d in _divisors(per_dp) if d <= MAX_MICRO_BATCH]
        for mbs in mbss:
            if per_dp % mbs:
                continue
            m = per_dp // mbs
            if "num_microbatches" in cons and cons["num_microbatches"] != m:
                continue
            if "virtual_stages" in cons:
                vs = [cons["virtual_stages"]]
            else:
                vs = [1] + ([x for x in (2, 3, 4, 5, 6, 8) if x <= MAX_VIRTUAL and pp * x <= shape.layers]
                            if pp > 1 else [])
            for v in vs:
                if v > 1 and (pp == 1 or m % pp or pp * v > shape.layers):
                    continue
                for zero in ([cons["zero"]] if "zero" in cons else [0, 1, 2, 3]):
                    if zero and dp * cp == 1 and "zero" not in cons:
                        continue
                    for rc in ([cons["recompute"]] if "recompute" in cons else list(RECOMPUTES)):
                        for sp in sps:
                            if sp and tp == 1:
                                continue
                            for scheme in schemes:
                                yield Parallel(tp, pp, dp, mbs, m, v, sp, zero, rc, cp, scheme, balanced)


def search(shape: ModelShape, config: ComputeConfig, name: str = "model",
           refuse: Callable[[Parallel], str | None] | None = None) -> ClusterPlan:
    """The fastest configuration that fits the memory budget (see the module docstring); ``refuse``: why a
    configuration is not considered, ``None`` to consider it (a compile's search: what the compiler does not
    lower, :func:`~nnscaler.cluster.plan.cp_refusal`); where it refuses every one, its reason is the error."""
    profile = get_profile(config.profile or "h100")
    if profile.cluster is None:
        raise PlanError(f"profile {profile.name!r} has no cluster constants; cluster plans need one of: "
                        f"{', '.join(n for n, p in _profiles().items() if p.cluster is not None)}")
    world = config.plan_ngpus
    cons = dict(config.constraints or {})
    gb = config.global_batch or shape.batch * world
    _check_fixed(shape, world, cons, gb)
    start = time.perf_counter()
    budget = config.mem_budget
    grad_bytes = 2 if config.grad_reduce_dtype == "bf16" else 4
    best: Estimate | None = None
    least: Estimate | None = None
    considered = feasible = 0
    refused: str | None = None  # the first refusal, said if every configuration is refused
    memo: dict = {}  # each (tp, sp, micro-batch size, recompute) costs its sections once
    for par in candidates(shape, world, gb, cons, profile.ranks_per_node):
        reason = refuse(par) if refuse is not None else None
        if reason:
            refused = refused or reason
            continue
        e = estimate(shape, par, profile, config.precision, gb, budget, grad_bytes, memo)
        considered += 1
        if least is None or e.memory["peak"] < least.memory["peak"]:
            least = e
        if e.fits:
            feasible += 1
            if best is None or e.step_seconds < best.step_seconds:
                best = e
    if considered == 0 and refused:
        raise PlanError(f"no configuration of {world} ranks under constraints {cons} can be compiled: {refused}")
    if considered == 0:
        raise PlanError(f"no configuration of {world} ranks satisfies constraints {cons} with global batch {gb} "
                        f"(tp must divide {shape.heads} heads, tp x cp x pp x dp = {world}, dp divide the batch)")
    if best is None:
        assert least is not None
        need = least.memory["peak"]
        limit = f"mem_budget={human(least.budget)}" if budget is not None else f"the device's {human(least.budget)}"
        raise PlanError(f"the model cannot fit in {limit} per rank on {world} x {profile.name}"
                        f"{' under constraints ' + str(cons) if cons else ''}: the smallest reachable is {human(need)} "
                        f"per rank ({_short(least.parallel)}); nearest feasible: about "
                        f"{_more_ranks(world, need, least.budget)} ranks, or mem_budget={human(need)}")
    return ClusterPlan(name, world, profile.name, config.precision, gb, shape, best, considered, feasible,
                       time.perf_counter() - start, cons)


def _short(p: Parallel) -> str:
    return (f"tp {p.tp}{' ' + cp_label(p) if p.cp > 1 else ''} pp {p.pp} dp {p.dp} zero {p.zero} recompute {p.recompute}"
            f"{' sp' if p.sequence_parallel else ''} micro-batch {p.micro_batch_size}")


def cp_label(p: Parallel) -> str:
    """``cp 16 (allgather)``, ``cp 4 (ring, unbalanced)``."""
    return f"cp {p.cp} ({p.cp_scheme}{'' if p.cp_balanced else ', unbalanced'})"


def _more_ranks(world: int, need: float, budget: float) -> int:
    return world * 2 ** max(1, math.ceil(math.log2(need / budget)))


def _profiles():
    from ..profiles import PROFILES
    return PROFILES


def plan_cluster(model: torch.nn.Module, sample_args: Sequence[Any], config: ComputeConfig,
                 sample_kwargs: dict | None = None, name: str | None = None) -> ClusterPlan:
    """Plan ``model`` for ``config.plan_ngpus`` devices of ``config.profile`` (default ``h100``): trace on
    meta, read the repeated blocks, search every outer configuration (:func:`search`)."""
    t0 = time.perf_counter()
    shape = trace_shape(model, sample_args, sample_kwargs)
    arch = architecture_of(model)
    plan = search(shape, config, name or (arch["transformers"] if arch else type(model).__name__))
    plan.architecture = arch
    plan.seconds = time.perf_counter() - t0
    return plan
