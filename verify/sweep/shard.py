"""Sweeps across machines: ``verify all --shard i/N`` runs a deterministic, time-balanced share of the
units, by the unit times recorded in :data:`TIMES` (committed, so every machine computes the same
shares); ``verify merge`` checks the shards' reports fit together (:func:`check_shards`).

The shares are the longest-processing-time-first assignment (each unit, longest first, to the share
with the least time so far): within 4/3 of the best possible balance, and in practice within a few
per cent when no unit is a large part of a share.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # annotations only: ``--shard`` is parsed without torch (verify/argcheck.py)
    from verify.sweep.selection import Unit

TIMES = Path(__file__).resolve().parents[1] / "unit_seconds.json"  # label -> seconds, from a recorded run
DEFAULT_SECONDS = {"op": 1.0, "model": 3.0, "torchpar": 5.0}  # a unit the record does not hold


class ShardError(ValueError):
    """A ``--shard`` that cannot be, or shards that do not fit together: one line."""


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/4"`` -> ``(2, 4)`` (1-based)."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text or "")
    if not m or not 1 <= int(m[1]) <= int(m[2]):
        raise ShardError(f"--shard {text!r}: give i/N with 1 <= i <= N, e.g. 1/4")
    return int(m[1]), int(m[2])


def recorded_times(path: Path = TIMES) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def _like(u: Unit) -> list[tuple]:
    """What an unrecorded unit's time is guessed from, closest first: the same model (or op) with and
    without a resume, then its kind with and without a resume."""
    return [(u.kind, u.name, u.checkpoint), (u.kind, u.name), (u.kind, u.checkpoint), (u.kind,)]


def estimate(units: Sequence[Unit], times: dict[str, float]) -> list[float]:
    """Seconds per unit: the recorded time (``times`` by label), else the median recorded time of the
    closest group it belongs to (:func:`_like`), else a default by kind."""
    groups: dict[tuple, list[float]] = {}
    for u in units:
        if u.label in times:
            for g in _like(u):
                groups.setdefault(g, []).append(times[u.label])
    typical = {g: median(v) for g, v in groups.items()}
    return [times[u.label] if u.label in times else
            next((typical[g] for g in _like(u) if g in typical), DEFAULT_SECONDS.get(u.kind, 3.0)) for u in units]


def assign(units: Sequence[Unit], n: int, times: dict[str, float]) -> list[int]:
    """The share (0-based) of each unit among ``n``, longest units first to the least loaded share."""
    secs = estimate(units, times)
    load = [0.0] * n
    out = [0] * len(units)
    for k in sorted(range(len(units)), key=lambda k: (-secs[k], units[k].label)):
        s = min(range(n), key=lambda i: (load[i], i))
        out[k] = s
        load[s] += secs[k]
    return out


def shard(units: Sequence[Unit], i: int, n: int, times: dict[str, float] | None = None) -> list[Unit]:
    """Share ``i`` (1-based) of ``n``, in the units' own order."""
    shares = assign(units, n, recorded_times() if times is None else times)
    return [u for u, s in zip(units, shares) if s == i - 1]


def fingerprint(units: Sequence[Unit]) -> str:
    """Names the whole selection the shares are cut from: shards of another selection do not merge."""
    return hashlib.sha256("\n".join(u.label for u in units).encode()).hexdigest()[:16]


def check_shards(metas: Sequence[dict]) -> None:
    """Raise :class:`ShardError` unless ``metas`` (each report's ``sweep``) are the N shares of one
    selection, each once, together holding every unit of it exactly once."""
    if not metas:
        raise ShardError("nothing to merge: give report directories of verify all --shard i/N runs")
    prints = {m.get("selection") for m in metas}
    if len(prints) != 1:
        raise ShardError("the reports come from different selections (other options or code); merge shards of one run")
    n = {m.get("shards", 1) for m in metas}
    if len(n) != 1:
        raise ShardError(f"the reports were cut into different numbers of shares: {sorted(n)}")
    n = n.pop()
    got = sorted(m.get("shard", 1) for m in metas)
    dup = sorted({s for s in got if got.count(s) > 1})
    if dup:
        raise ShardError(f"shard {dup[0]}/{n} given twice")
    missing = sorted(set(range(1, n + 1)) - set(got))
    if missing:
        raise ShardError(f"shard {missing[0]}/{n} is missing ({len(missing)} of {n} missing)")
    total = metas[0].get("total")
    units = [u for m in metas for u in m.get("units", [])]
    seen: set = set()
    dups = [u for u in units if u in seen or seen.add(u)]
    if dups:
        raise ShardError(f"unit {dups[0]!r} is in two shards")
    if total is not None and len(units) != total:
        raise ShardError(f"the shards hold {len(units)} units of the selection's {total}: some did not finish "
                         f"(rerun them with --resume)")
