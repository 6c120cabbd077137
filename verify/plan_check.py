"""Compile only what passed: every (operator, partition) pair a plan uses, verified on the ranks that
will run it, before the program is generated.

Each pair is run exactly as ``python -m verify op`` runs a case (the single-device reference in the
dtype and in float64, the partitioned op on real ranks, every output and input gradient judged by
:mod:`verify.compare`), at the lengths the traced model gives it. Verdicts are cached on disk, keyed
by everything that decides them (the spec, its annotation and fixed arguments, the bound lengths,
the partition, the world size, the dtype, the torch and harness versions), so a second compile of
the same model verifies nothing. A cache file that cannot be read is ignored and rebuilt.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist

from nnscaler.dimops.partition import Partition
from nnscaler.ir.graph import IRGraph, IROp, IRTensor
from nnscaler.policies.plan import Plan
from nnscaler.runtime.mesh import GroupCache, RankMesh, mesh_shapes
from nnscaler.ops.spec import resolve
from nnscaler.runtime.partitioned import as_tuple

from . import rank_case
from .samples import Sample, input_values

HARNESS_VERSION = "1"
DEFAULT_CACHE = Path(os.path.expanduser("~")) / ".cache" / "nnscaler-verify" / "verdicts.json"


class PlanVerificationError(RuntimeError):
    """An operator of the plan failed verification under the partition the plan gives it."""


@dataclass(frozen=True)
class PairVerdict:
    """The verdict on one (operator, partition) pair of a plan."""

    op: str  # IR name of the first operator using the pair
    spec: str
    partition: str
    ok: bool
    reason: str = ""
    cached: bool = False


def _op_partition(plan: Plan, op: IROp) -> Partition:
    p = plan.partition(op)
    return Partition(tuple((i, f) for i, f in p.splits if i is not None), p.world_size)


def pair_key(op: IROp, partition: Partition, dtype: str) -> str:
    """The cache key of one pair: what decides its verdict, hashed."""
    spec = op.spec
    text = json.dumps([spec.name, spec.annotation, repr(sorted(spec.args.items())), repr(sorted(spec.kwargs.items())),
                       repr(getattr(spec.fn, "__qualname__", spec.fn)), sorted(op.bound.sizes.items()),
                       partition.label, partition.world_size, dtype, torch.__version__, HARNESS_VERSION])
    return hashlib.sha256(text.encode()).hexdigest()


def _load_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) and all(isinstance(v, dict) for v in data.values()) else {}
    except (OSError, ValueError):
        return {}  # missing or corrupt: never trusted, rebuilt


def _save_cache(path: Path, cache: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=0))
    tmp.replace(path)


def _sample(op: IROp, seed: int) -> Sample:
    """Inputs at the op's traced lengths and dtypes (constraints of the spec honoured)."""
    spec, bound = op.spec, op.bound
    inputs = []
    g = torch.Generator().manual_seed(seed)
    for pos, t in enumerate(spec.anno.inputs):
        x = op.inputs[pos] if pos < len(op.inputs) else None
        dtype = x.dtype if isinstance(x, IRTensor) else torch.float32
        inputs.append(input_values(spec, pos, bound, dtype, g))
    with torch.no_grad():
        outs = as_tuple(spec.fn(*inputs, **resolve(dict(spec.kwargs), bound.sizes)))
    cots = [torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.dtype)
            if isinstance(y, torch.Tensor) and y.is_floating_point() and spec.differentiable else None for y in outs]
    dtype = next((x.dtype for x in inputs if isinstance(x, torch.Tensor) and x.is_floating_point()), torch.float32)
    return Sample(spec, bound, inputs, cots, dtype, seed)


def plan_pairs(graph: IRGraph, plan: Plan, dtype: str) -> dict[str, tuple[IROp, Partition]]:
    """The distinct (operator, partition) pairs of a plan, by cache key, first use first."""
    out: dict[str, tuple[IROp, Partition]] = {}
    for op in graph.ops:
        if op.known:
            part = _op_partition(plan, op)
            out.setdefault(pair_key(op, part, dtype), (op, part))
    return out


def verify_plan(graph: IRGraph, plan: Plan, *, groups: GroupCache | None = None, rank: int | None = None,
                cache_path: str | os.PathLike | None = None, dtype: str = "float32", seed: int = 0
                ) -> list[PairVerdict]:
    """Verify every pair of ``plan`` not already in the cache, on the ranks of the default process
    group (every rank of the plan calls this, in the same order); returns one verdict per pair."""
    path = Path(cache_path) if cache_path is not None else DEFAULT_CACHE
    world = plan.world_size
    rank = dist.get_rank() if rank is None else rank
    cache = _load_cache(path)
    pairs = plan_pairs(graph, plan, dtype)
    todo = [k for k in pairs if k not in cache]
    if todo and groups is None:
        groups = GroupCache()
        groups.create_for_shapes(mesh_shapes(world))
    verdicts = []
    device = torch.device("cpu")
    for key, (op, part) in pairs.items():
        if key in cache:
            v = cache[key]
            verdicts.append(PairVerdict(op.name, op.spec.name, part.label, v["ok"], v.get("reason", ""), True))
            continue
        try:
            sample = _sample(op, seed)
            ref = rank_case.reference(sample, device)
            mesh = RankMesh.build(part.mesh_shape, rank, groups)
            checks = rank_case.run_case(sample, ref, part, mesh, device)
            bad = next((c for c in checks if not c.ok), None)
            mine = (bad is None and bool(checks), "" if bad is None else f"{bad.name}: {bad.reason}")
        except Exception as exc:  # noqa: BLE001  (a pair that cannot run is a failed pair)
            mine = (False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        ok = all(o for o, _ in everyone)
        reason = next((r for o, r in everyone if not o), "")
        cache[key] = {"ok": ok, "reason": reason, "spec": op.spec.name, "partition": part.label}
        verdicts.append(PairVerdict(op.name, op.spec.name, part.label, ok, reason))
    if todo and rank == 0:
        try:
            _save_cache(path, cache)
        except OSError as exc:  # an unwritable cache costs the next compile time, never correctness
            warnings.warn(f"cannot write the verification cache {path}: {exc}; verdicts are not kept")
    return verdicts


def failures(verdicts: Iterable[PairVerdict]) -> list[PairVerdict]:
    return [v for v in verdicts if not v.ok]
