"""What the cluster cost model was fitted on and how well it held on runs it was not fitted to, and the lines a
plan's report draws from it: whether its estimate lies within the calibrated range (device generation, GPU
count, parallelism kinds seen in the published runs) or extrapolates and by how much, and whether it claims
more than the best published run at that scale by more than the held-out error.

The record is ``published_runs.csv`` beside this module (package data; its header cites every source): every
published run with its device, GPU count and published configuration (whose parallelism kinds :func:`row_kinds`
names), and two columns ``python bench/calibration/calibrate.py --holdout --write`` fills: ``mfu`` (measured: model
FLOPs / (step time x GPUs x dense bf16 peak)) and ``held_out`` (its leave-one-source-out error, estimate / published
- 1, the constants fitted without the run's source). The same file is the calibration's input: one table, read by
both.
"""
from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass
from pathlib import Path

CSV = Path(__file__).resolve().with_name("published_runs.csv")


@dataclass(frozen=True)
class Run:
    """One published run as the evidence record keeps it."""

    name: str
    device: str
    gpus: int
    kinds: frozenset
    mfu: float  # measured: model FLOPs / (step time x GPUs x dense bf16 peak)
    held_out: float  # estimate / published - 1, fitted without this run's source


def load_rows(path: Path = CSV) -> list[dict]:
    """The published runs' rows (the ``#`` header lines skipped), every field a string as written."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return list(csv.DictReader(lines))


def recompute_of(row: dict) -> str:
    """The row's recompute as the planner names it (torchtitan's per-op selective AC is ``selective``)."""
    return "selective" if row["recompute"] == "selective-op" else row["recompute"]


def row_kinds(row: dict) -> set[str]:
    """The parallelism kinds a published row's published fields name (as :func:`plan_kinds` names a plan's)."""
    kinds = set()
    tp, pp, dp, cp = (int(row.get(k) or 1) for k in ("tp", "pp", "dp", "cp"))
    kinds |= {"tp"} if tp > 1 else set()
    kinds |= {"pp"} if pp > 1 else set()
    kinds |= {"dp"} if dp > 1 else set()
    if row["sequence_parallel"] == "True" and tp > 1:
        kinds.add("sp")
    if row["virtual_stages"] and int(row["virtual_stages"]) > 1:
        kinds.add("interleaved")
    if row["zero"] and dp > 1:
        kinds.add(f"zero{row['zero']}")
    if row["recompute"]:
        kinds.add(f"recompute-{recompute_of(row)}")
    if cp > 1:
        kinds.add(f"cp-{row.get('cp_scheme') or 'allgather'}")
    return kinds


def load_runs(path: Path = CSV) -> tuple[Run, ...]:
    """The runs of ``path`` whose ``mfu`` and ``held_out`` the calibration has written."""
    return tuple(Run(r["name"], r["device"], int(r["gpus"]), frozenset(row_kinds(r)), float(r["mfu"]),
                     float(r["held_out"])) for r in load_rows(path) if r.get("mfu") and r.get("held_out"))


RUNS: tuple[Run, ...] = load_runs()

SIMILAR_SCALE = 4  # published runs within this factor of a plan's GPU count count as "similar scale"


def plan_kinds(par) -> set[str]:
    """The parallelism kinds a configuration uses, named as :data:`RUNS` names them."""
    kinds = {f"recompute-{par.recompute}"} | ({f"zero{par.zero}"} if par.dp > 1 else set())
    if par.tp > 1:
        kinds.add("tp")
    if par.sequence_parallel and par.tp > 1:
        kinds.add("sp")
    if par.pp > 1:
        kinds.add("pp")
    if par.virtual_stages > 1:
        kinds.add("interleaved")
    if par.dp > 1:
        kinds.add("dp")
    if getattr(par, "cp", 1) > 1:  # context parallelism by its scheme: no fitted run has one yet
        kinds.add(f"cp-{par.cp_scheme}")
    return kinds


def held_out_error(runs: tuple[Run, ...] = RUNS) -> tuple[float, float]:
    """(median, worst) absolute held-out error over ``runs``; (nan, nan) when there are none."""
    a = [abs(r.held_out) for r in runs]
    return (statistics.median(a), max(a)) if a else (float("nan"), float("nan"))


def claims(device: str, world: int, par, mfu: float, runs: tuple[Run, ...] = RUNS) -> list[str]:
    """The report lines bounding a plan's estimate by the evidence (see the module docstring)."""
    if not runs:
        return ["calibration: no published runs recorded; the estimate is unvalidated"]
    median, worst = held_out_error(runs)
    err = (f"held-out error of the cost model: median {100 * median:.1f}%, worst {100 * worst:.1f}% over {len(runs)} "
           f"runs")
    here = [r for r in runs if r.device == device]
    if not here:
        seen = ", ".join(sorted({r.device for r in runs}))
        return [f"calibration: EXTRAPOLATED: no published {device} run was fitted (fitted: {seen}); {err}"]
    out = []
    lo, hi = min(r.gpus for r in here), max(r.gpus for r in here)
    if world > hi:
        out.append(f"{world} GPUs is {world / hi:.1f}x the largest fitted {device} run ({hi})")
    elif world < lo:
        out.append(f"{world} GPUs is {lo / world:.1f}x below the smallest fitted {device} run ({lo})")
    unseen = sorted(plan_kinds(par) - set().union(*(r.kinds for r in here)))
    if unseen:
        out.append(f"{', '.join(unseen)} not in any fitted {device} run")
    lines = [f"calibration: EXTRAPOLATED: {'; '.join(out)}; {err}" if out else
             f"calibration: within the calibrated range ({device}, {lo}-{hi} GPUs, the parallelism kinds of this plan "
             f"seen in fitted runs); {err}"]
    near = [r for r in here if r.gpus * SIMILAR_SCALE >= world and r.gpus <= world * SIMILAR_SCALE]
    best = max(near or here, key=lambda r: r.mfu)
    if mfu > best.mfu * (1 + median):
        scale = "similar scale" if near else "any scale (none at similar scale)"
        lines.append(f"claim beyond evidence: estimated MFU {100 * mfu:.1f}% is {100 * (mfu / best.mfu - 1):.0f}% "
                     f"above "
                     f"the best published {device} run at {scale} ({best.name}, {best.gpus} GPUs, MFU "
                     f"{100 * best.mfu:.1f}%), more than the held-out error ({100 * median:.1f}%): unconfirmed")
    return lines
