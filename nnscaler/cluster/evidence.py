"""What the cluster cost model was fitted on and how well it held on runs it was not fitted to, and the lines a
plan's report draws from it: whether its estimate lies within the calibrated range (device generation, GPU
count, parallelism kinds seen in the published runs) or extrapolates and by how much, and whether it claims
more than the best published run at that scale by more than the held-out error.

The record below is what ``python bench/calibration/calibrate.py --holdout`` prints (its "evidence" block):
every published run of ``bench/published_runs.csv`` with its device, GPU count, the parallelism kinds its
published configuration names, its measured MFU, and its leave-one-source-out error (estimate / published - 1,
the constants fitted without the run's source). ``tests/compiler/test_evidence.py`` holds it to the CSV.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Run:
    """One published run as the evidence record keeps it."""

    name: str
    device: str
    gpus: int
    kinds: frozenset
    mfu: float  # measured: model FLOPs / (step time x GPUs x dense bf16 peak)
    held_out: float  # estimate / published - 1, fitted without this run's source


def _r(name: str, device: str, gpus: int, kinds: str, mfu: float, held_out: float) -> Run:
    return Run(name, device, gpus, frozenset(kinds.split()), mfu, held_out)


# --- printed by `python bench/calibration/calibrate.py --holdout` (the evidence block); paste it here when the
# cost model, its constants or bench/published_runs.csv change
RUNS: tuple[Run, ...] = (
    _r("llama3-405b-8k", "h100", 8192, "dp pp tp", 0.4346, +0.2156),
    _r("llama3-405b-16k", "h100", 16384, "dp pp tp", 0.4043, +0.2559),
    _r("tt-a100-llama3-8b", "a100", 64, "dp recompute-selective zero3", 0.5903, +0.0065),
    _r("tt-a100-llama3-70b", "a100", 64, "dp recompute-full zero3", 0.5300, -0.0608),
    _r("tt-a100-llama2-13b-noac", "a100", 64, "dp recompute-none zero3", 0.6739, -0.0319),
    _r("tt-a100-llama2-13b-sel", "a100", 64, "dp recompute-selective zero3", 0.5935, -0.0006),
    _r("tt-a100-llama2-70b-sel", "a100", 64, "dp recompute-selective zero3", 0.5264, -0.1316),
    _r("tt-a100-llama2-70b-full", "a100", 64, "dp recompute-full zero3", 0.5234, -0.0659),
    _r("tt-h100-llama3-8b", "h100", 8, "dp recompute-selective zero3", 0.3608, +0.0633),
    _r("tt-h100-llama3-405b", "h100", 128, "dp recompute-full sp tp zero3", 0.2952, +0.1739),
    _r("tt-h100-llama3-8b-compile", "h100", 8, "dp recompute-selective zero3", 0.4174, +0.0410),
    _r("tt-h100-llama3-8b-128", "h100", 128, "dp recompute-selective zero3", 0.3509, -0.0238),
    _r("tt-h100-llama3-8b-128-compile", "h100", 128, "dp recompute-selective zero3", 0.4078, -0.0505),
    _r("tt-h100-llama3-70b-tp8", "h100", 256, "dp recompute-full tp zero3", 0.3016, -0.1041),
    _r("tt-h100-llama3-8b-tp8", "h100", 64, "dp recompute-selective tp zero3", 0.2741, -0.1380),
    _r("sc21-gpt-1.7b", "a100", 32, "dp recompute-full zero0", 0.3293, -0.0420),
    _r("sc21-gpt-3.6b", "a100", 64, "dp recompute-full tp zero0", 0.3317, -0.0459),
    _r("sc21-gpt-7.5b", "a100", 128, "dp recompute-full tp zero0", 0.3413, -0.0335),
    _r("sc21-gpt-18b", "a100", 256, "dp recompute-full tp zero0", 0.3245, -0.0255),
    _r("sc21-gpt-39b", "a100", 512, "dp pp recompute-full tp zero0", 0.3317, -0.0099),
    _r("sc21-gpt-76b", "a100", 1024, "dp interleaved pp recompute-full tp zero0", 0.3365, -0.0318),
    _r("sc21-gpt-145b", "a100", 1536, "dp interleaved pp recompute-full tp zero0", 0.3558, -0.0335),
    _r("sc21-gpt-310b", "a100", 1920, "dp interleaved pp recompute-full tp zero0", 0.3726, -0.0546),
    _r("sc21-gpt-530b", "a100", 2520, "dp interleaved pp recompute-full tp zero0", 0.3918, +0.0264),
    _r("sc21-gpt-1t", "a100", 3072, "dp pp recompute-full tp zero0", 0.3918, -0.0724),
    _r("mc-gpt-1.7b", "h100", 48, "dp", 0.4132, -0.0970),
    _r("mc-gpt-7.1b", "h100", 96, "dp tp", 0.4709, -0.0808),
    _r("mc-gpt-16b", "h100", 192, "dp tp", 0.4943, -0.0250),
    _r("mc-gpt-32b", "h100", 384, "dp tp", 0.4645, +0.0570),
    _r("mc-gpt-70b", "h100", 768, "dp pp tp", 0.4242, +0.0994),
    _r("mc-gpt-119b", "h100", 1536, "dp pp tp", 0.4250, -0.0058),
    _r("mc-gpt-177b", "h100", 2304, "dp pp tp", 0.4374, +0.0533),
    _r("mc-gpt-314b", "h100", 3072, "dp pp tp", 0.4795, +0.1160),
    _r("mc-gpt-462b", "h100", 6144, "dp pp tp", 0.4648, +0.0289),
    _r("mpt-7b-a100-mbs1", "a100", 8, "dp recompute-none zero3", 0.4651, -0.0379),
    _r("mpt-7b-a100-mbs2", "a100", 8, "dp recompute-none zero3", 0.5588, -0.0612),
    _r("mpt-7b-a100-mbs4", "a100", 8, "dp recompute-none zero3", 0.6236, -0.0735),
    _r("mpt-7b-a100-mbs6", "a100", 8, "dp recompute-none zero3", 0.6515, -0.0571),
    _r("mpt-13b-a100-mbs1", "a100", 8, "dp recompute-none zero3", 0.4912, -0.0126),
    _r("mpt-13b-a100-mbs2", "a100", 8, "dp recompute-none zero3", 0.5861, -0.0485),
)
# --- end of the printed block

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
