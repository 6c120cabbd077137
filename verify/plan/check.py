"""Compile only what passed: every (operator, partition) pair a plan uses, verified on the ranks that
will run it, before the program is generated.

Each pair is run exactly as ``python -m verify op`` runs a case (the single-device reference in the
dtype and in float64, the partitioned op on real ranks, every output and input gradient judged by
:mod:`verify.judge.compare`), at reduced lengths equivalent to the traced ones for its annotation and
partition (:mod:`verify.plan.shrink`; the traced lengths where the op does not fit them). Verdicts
are cached on disk, keyed by everything that decides them (the spec's annotation, arguments,
constraints, tolerance and code, the input dtypes, the lengths verified, the partition, the world
size, the dtype, the torch and harness versions), so a second compile of the same model verifies
nothing. A cache file that cannot be read is ignored and rebuilt.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist

from nnscaler.dimops.binding import BoundAnno
from nnscaler.dimops.partition import Partition
from nnscaler.ir.graph import IRGraph, IROp, IRTensor
from nnscaler.io import atomic_write
from nnscaler.ir.plan import Plan
from nnscaler.runtime.mesh import GroupCache, RankMesh, mesh_shapes

from verify.cases import op as rank_case
from verify.plan.shrink import fits, reduced_bound
from verify.cases.op import op_partition
from verify.cases.samples import op_sample

HARNESS_VERSION = "2"  # bump when what a verdict means changes (2: reduced lengths, see verify.plan.shrink)
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


@dataclass(frozen=True)
class Pair:
    """One distinct (operator, partition) pair: the first op using it, its partition, the reduced
    binding to try (``None``: verified at the traced lengths) and the cache keys of both."""

    op: IROp
    partition: Partition
    small: BoundAnno | None
    key: str  # of the reduced problem when there is one, else of the traced one
    full_key: str


def _source(fn) -> str:
    """What identifies a function's behaviour: its source where Python has it (a ``partial`` by its
    function and bound arguments), else its name."""
    if fn is None:
        return ""
    if isinstance(fn, functools.partial):
        return f"partial({_source(fn.func)}, {fn.args!r}, {sorted(fn.keywords.items())!r})"
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()
    except (OSError, TypeError):
        return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # a repr's memory address differs in every process


def pair_key(op: IROp, partition: Partition, dtype: str, sizes: dict | None = None) -> str:
    """The cache key of one pair at ``sizes`` (default: the traced lengths): what decides its
    verdict (the spec's annotation, arguments, constraints, tolerance and code, the input dtypes,
    the lengths, the partition, the world size, the dtype, the torch and harness versions), hashed."""
    spec = op.spec
    dtypes = [str(x.dtype) for x in op.inputs if isinstance(x, IRTensor)]
    text = json.dumps([spec.name, spec.annotation, repr(sorted(spec.args.items())), repr(sorted(spec.kwargs.items())),
                       repr(sorted(spec.inputs.items())), repr(spec.tolerance), spec.differentiable,
                       _source(spec.fn), _source(spec.local), dtypes,
                       sorted((op.bound.sizes if sizes is None else sizes).items()),
                       partition.label, partition.world_size, dtype, torch.__version__, HARNESS_VERSION])
    return hashlib.sha256(_ADDRESS.sub("", text).encode()).hexdigest()


def _load_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) and all(isinstance(v, dict) for v in data.values()) else {}
    except (OSError, ValueError, UnicodeDecodeError):
        return {}  # missing or corrupt: never trusted, rebuilt


def _save_cache(path: Path, cache: dict) -> None:
    if path.exists() and not path.is_file():
        raise OSError(f"{path} is not a file")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(cache, indent=0))


def plan_pairs(graph: IRGraph, plan: Plan, dtype: str, reduce: bool = True) -> dict[str, Pair]:
    """The distinct (operator, partition) pairs of a plan, by cache key, first use first
    (``reduce=False``: each at its traced lengths)."""
    out: dict[str, Pair] = {}
    for op in graph.ops:
        if op.known:
            part = op_partition(plan, op)
            small = reduced_bound(op.spec, op.bound, part) if reduce else None
            full = pair_key(op, part, dtype)
            key = full if small is None else pair_key(op, part, dtype, small.sizes)
            out.setdefault(key, Pair(op, part, small, key, full))
    return out


def _cached(pair: Pair, cache: dict) -> dict | None:
    """The cached verdict of a pair: of its reduced problem, or of its traced one where the op
    does not fit its reduced lengths (``{"unfit": true}`` under the reduced key)."""
    hit = cache.get(pair.key)
    if hit is not None and hit.get("unfit"):
        hit = cache.get(pair.full_key)
    return hit if hit is not None and isinstance(hit.get("ok"), bool) else None


def _run_pair(pair: Pair, rank: int, groups: GroupCache, seed: int, cache: dict) -> tuple[bool, str, str]:
    """Verify one pair on this rank: (ok, reason, key the verdict belongs to)."""
    op, part = pair.op, pair.partition
    key, sample = pair.full_key, None
    if pair.small is not None and not cache.get(pair.key, {}).get("unfit"):
        try:
            small, outs = op_sample(op, pair.small, seed)
            if fits(pair.small, outs):
                key, sample = pair.key, small
        except Exception:  # noqa: BLE001  (an op that cannot run reduced is verified at its traced lengths)
            pass
        if sample is None:
            cache[pair.key] = {"unfit": True, "spec": op.spec.name}
    try:
        if sample is None:
            sample, _ = op_sample(op, op.bound, seed)
        device = torch.device("cpu")
        ref = rank_case.reference(sample, device)
        mesh = RankMesh.build(part.mesh_shape, rank, groups)
        checks = rank_case.run_case(sample, ref, part, mesh, device)
        bad = next((c for c in checks if not c.ok), None)
        return bad is None and bool(checks), "" if bad is None else f"{bad.name}: {bad.reason}", key
    except Exception as exc:  # noqa: BLE001  (a pair that cannot run is a failed pair)
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", key


def cached_verdicts(graph: IRGraph, plan: Plan, cache_path: str | os.PathLike | None = None,
                    dtype: str = "float32") -> list[PairVerdict] | None:
    """Every pair's verdict from the cache, or ``None`` when any pair is not there."""
    cache = _load_cache(Path(cache_path) if cache_path is not None else DEFAULT_CACHE)
    out = []
    for pair in plan_pairs(graph, plan, dtype).values():
        hit = _cached(pair, cache)
        if hit is None:
            return None
        out.append(PairVerdict(pair.op.name, pair.op.spec.name, pair.partition.label, hit["ok"],
                               hit.get("reason", ""), True))
    return out


def verify_plan(graph: IRGraph, plan: Plan, *, groups: GroupCache | None = None, rank: int | None = None,
                cache_path: str | os.PathLike | None = None, dtype: str = "float32", seed: int = 0,
                group=None, reduce: bool = True) -> list[PairVerdict]:
    """Verify every pair of ``plan`` not already in the cache, on ``plan.world_size`` ranks (``group``:
    their process group, default the whole default group; every one of them calls this, in the same
    order, each with its ``rank`` in the plan); returns one verdict per pair. ``reduce=False``
    verifies every pair at its traced lengths (for measuring what the reduction saves)."""
    path = Path(cache_path) if cache_path is not None else DEFAULT_CACHE
    world = plan.world_size
    rank = dist.get_rank(group) if rank is None else rank
    cache = _load_cache(path)
    pairs = plan_pairs(graph, plan, dtype, reduce)
    mine = sorted(k for k, p in pairs.items() if _cached(p, cache) is None)
    everyone: list = [None] * world  # ranks may have read different caches: what any rank lacks, all run
    dist.all_gather_object(everyone, mine, group=group)
    todo = set().union(*map(set, everyone))
    if todo and groups is None:
        groups = GroupCache()
        groups.create_for_shapes(mesh_shapes(world))
    verdicts = []
    for key, pair in pairs.items():
        op, part = pair.op, pair.partition
        hit = None if key in todo else _cached(pair, cache)
        if hit is not None:
            verdicts.append(PairVerdict(op.name, op.spec.name, part.label, hit["ok"], hit.get("reason", ""), True))
            continue
        answer = _run_pair(pair, rank, groups, seed, cache)
        everyone = [None] * world
        dist.all_gather_object(everyone, answer, group=group)
        ok = all(o for o, _, _ in everyone)
        reason = next((r for o, r, _ in everyone if not o), "")
        cache[answer[2]] = {"ok": ok, "reason": reason, "spec": op.spec.name, "partition": part.label}
        verdicts.append(PairVerdict(op.name, op.spec.name, part.label, ok, reason))
    if todo and rank == 0:
        try:
            _save_cache(path, cache)
        except OSError as exc:  # an unwritable cache costs the next compile time, never correctness
            warnings.warn(f"cannot write the verification cache {path}: {exc}; verdicts are not kept")
    return verdicts


def failures(verdicts: Iterable[PairVerdict]) -> list[PairVerdict]:
    return [v for v in verdicts if not v.ok]
