"""Memory per rank measured at real width on fake tensors, against the cluster planner's estimate (issue #38 item 4):
the plans measured, the comparison and its table.

For each cluster plan ``bench/calibration/autodist.py`` prints (Llama-3 8B and 70B at seq 4096, and the search
on every published row, Llama and GPT, 8B-405B on 8-16,384 GPUs), rank 0 of the stages the estimate takes its maxima
from is measured by :mod:`bench.calibration.fake_stage` (one rank's stage compiled at real widths on fake tensors and
run through two training steps). A plan with context parallelism is measured as the best plan without it
(:func:`without_cp`).

Estimate: :func:`nnscaler.cluster.cost.estimate` as the planner reports it (each term the larger of the first and the
last stage), at the micro-batches the measurement runs (:func:`estimated`). Goal: every ratio within 10%. A plan
whose measured peak exceeds the usable part of its device's memory is flagged in the table (``over the device``),
whatever budget the search was given (:func:`device_bytes`).

    python bench/calibration/real_memory.py [--plans llama3-8b-8 ...] [--skip-published] [--extrapolate] [--out FILE]

Each plan measured is recorded in ``bench/results/real_memory.json`` (:mod:`bench.calibration.memory_record`; not with
``--no-record``), which ``bench/calibration/autodist.py`` reads.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.calibration.fake_stage import GiB, HIGH, KEYS, LOW, measured, microbatches_run  # noqa: E402

def estimated(plan) -> dict:
    """The planner's bytes per ``KEYS`` for the program measured, nnscaler's. A published row's plan was searched
    with that stack's profile (``bench/calibration/calibrate.py`` ``row_profile``: bf16 weights, so no bf16 copies of
    fp32 weights kept for backward, and every saved tensor at 2 bytes), while the program compiled here keeps fp32
    master weights under autocast: its configuration is estimated again with the device's own profile (what
    ``plan_cluster`` uses; the same figures for a plan searched with it). Without this, Llama-3 8B at seq 8192
    (``search-tt-a100-llama3-8b``) read 51.2 GiB of saved activations against 88.2 measured.
    Pipelined, at the micro-batches the measurement runs (:func:`microbatches_run`): the runtime's receive buffers
    grow with the step's micro-batches (``nnscaler.cluster.memory.stage_boundaries``), and the figures are compared on
    the same step; the planner's own peak at the plan's micro-batches is ``plan.best.memory["peak"]``."""
    import dataclasses

    from nnscaler.cluster.cost import estimate
    from nnscaler.profiles import get_profile
    par = plan.parallel
    if par.pp > 1:
        par = dataclasses.replace(par, num_microbatches=microbatches_run(par))
    e = estimate(plan.shape, par, get_profile(plan.profile), plan.precision, plan.global_batch)
    return {k: e.memory[k] for k in KEYS}


def compare(got: dict, est: dict) -> dict:
    """``{key: estimate / measured}``."""
    return {k: est[k] / got[k] if got[k] else float("nan") for k in KEYS}


def _short(p) -> str:
    return (f"tp{p.tp}{'+sp' if p.sequence_parallel else ''}{f' cp{p.cp}' if p.cp > 1 else ''} pp{p.pp} "
            f"v{p.virtual_stages} dp{p.dp} "
            f"mbs{p.micro_batch_size} x{p.num_microbatches} zero{p.zero} {p.recompute}")


def without_cp(plan, search_again):
    """``plan``, or where it takes context parallelism the best plan without (``search_again(constraints)``): the
    measurement compiles each chunk without a cp split (``measure_stage`` reads no ``cp``), so a cp plan measured as
    it is would be another program (twice the tokens per rank at cp 2; its ZeRO shards over dp only)."""
    return plan if plan.parallel.cp == 1 else search_again({"cp": 1})


def plans(skip_published: bool = False, only: list[str] | None = None):
    """``(label, ClusterPlan, device GiB or None)`` for every plan ``bench/calibration/autodist.py`` prints (a cp plan:
    the best one without cp, :func:`without_cp`; the device's memory: a published row's, None for the profile's)."""
    from bench.calibration.llama_models import CLUSTER_RUNS
    from bench.calibration.llama_models import llama_shape
    from nnscaler import ComputeConfig
    from nnscaler.cluster.search import search
    for name, worlds in CLUSTER_RUNS:
        shape = None
        for w in worlds:
            label = f"{name}-{w}"
            if only and label not in only:
                continue
            shape = shape or llama_shape(name, 4096)
            cfg = ComputeConfig(w, profile="h100", precision="bf16-mixed", global_batch=2 * w)
            yield label, without_cp(search(shape, cfg, name),
                                    lambda cons: search(shape, dataclasses.replace(cfg, constraints=cons), name)), None
    if skip_published:
        return
    from bench.calibration.calibrate import load_rows, row_search, shapes_for
    rows = [r for r in load_rows() if not only or f"search-{r['name']}" in only]
    shapes = shapes_for(rows)
    for r in rows:
        shape = shapes[(r["model"], int(r["seq"]))]  # the rows' plans as bench/calibration/autodist.py prints them
        yield f"search-{r['name']}", without_cp(row_search(r, shape)[1],
                                                lambda cons: row_search(r, shape, cons=cons)[1]), float(r["memory_gib"])


def _gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def worst(got: dict, est: dict) -> float:
    """The largest ``|estimate / measured - 1|`` over ``KEYS``."""
    return max(abs(r - 1) for r in compare(got, est).values())


def device_bytes(plan, memory_gib: float | None = None) -> float:
    """What a plan may fill on its device: the profile's ``usable`` part of the device's memory (``memory_gib``: a
    published row's own device, e.g. 96 GiB H100s), whatever memory budget the search was given. A published row's
    search is allowed the memory our estimate says that run took (``calibrate.row_search``), which can be above the
    device (Llama 3 405B: 124 GiB): judged against that budget such a plan would always "fit"."""
    from nnscaler.profiles import get_profile
    prof = get_profile(plan.profile) if isinstance(plan.profile, str) else plan.profile
    return prof.cluster.usable * (memory_gib * GiB if memory_gib else prof.memory)


def over_device(plan, got: dict, memory_gib: float | None = None) -> bool:
    """Whether the measured peak exceeds what the plan's device holds (:func:`device_bytes`)."""
    return got["peak"] > device_bytes(plan, memory_gib)


def device_line(plan, got: dict, memory_gib: float | None = None) -> str:
    """One line on the measured peak against the estimate and the device (``OVER THE DEVICE`` when over)."""
    head = (f"measured peak {_gib(got['peak'])} GiB/rank (estimate {_gib(plan.best.memory['peak'])}, "
            f"device {_gib(device_bytes(plan, memory_gib))}, search budget {_gib(plan.best.budget)})")
    return (f"{head}: OVER THE DEVICE, this plan does not fit" if over_device(plan, got, memory_gib)
            else f"{head}: fits")


def row(label: str, plan, got: dict, est: dict, memory_gib: float | None = None) -> str:
    ratio = compare(got, est)
    cells = " | ".join(f"{_gib(got[k])} / {_gib(est[k])} = {ratio[k]:.2f}" for k in KEYS)
    over = (f" **over the device** ({_gib(device_bytes(plan, memory_gib))} GiB usable)"
            if over_device(plan, got, memory_gib) else "")
    return (f"| {label} | {_short(plan.parallel)} | {cells} | {_gib(got['held'])} | "
            f"{100 * worst(got, est):.0f}%{over} |")


def memory_line(label: str, plan, memory_gib: float | None = None, path=None) -> tuple[str, float | None]:
    """One line on ``plan``'s memory measured at real size against today's estimate (the largest ``|estimate /
    measured - 1|`` over params, grads, optimizer, saved activations and peak; goal 10%), and that figure (``None``:
    nothing on record for this configuration, the line says why; the record: bench/calibration/memory_record.py)."""
    from bench.calibration.memory_record import RECORD, measured_for  # the record reads nothing of this module
    got, why = measured_for(label, plan, path or RECORD)
    if got is None:
        return f"memory: {why}", None
    est = estimated(plan)
    w = worst(got, est)
    over = (f"; OVER THE DEVICE ({_gib(device_bytes(plan, memory_gib))} GiB usable)"
            if over_device(plan, got, memory_gib) else "")
    return (f"memory measured at real size: peak {_gib(got['peak'])} GiB/rank (estimate {_gib(est['peak'])}), worst "
            f"|estimate / measured - 1| {100 * w:.0f}% (goal 10%){over}"), w


HEADER = ("| plan | configuration | params | grads | optimizer | saved activations in flight | peak | "
          "held at the peak beyond state | worst |\n|---|---|---|---|---|---|---|---|---|")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", nargs="*", help="labels to measure (e.g. llama3-8b-8 search-tt-h100-llama3-8b)")
    ap.add_argument("--skip-published", action="store_true")
    ap.add_argument("--extrapolate", action="store_true",
                    help=f"compile each chunk at {LOW} and {HIGH} blocks and extrapolate linearly (faster)")
    ap.add_argument("--out", help="also write the table to this Markdown file")
    ap.add_argument("--json", help="also write each plan's configuration, measured and estimated bytes to this file")
    ap.add_argument("--no-record", action="store_true",
                    help="do not record the measurements in bench/results/real_memory.json (bench/calibration/memory_record.py, "
                         "which bench/calibration/autodist.py reads)")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    lines = ["GiB per rank, measured (rank 0 of the first and, pipelined, the last and the fullest middle stage: the largest) / estimated "
             "(`nnscaler.cluster.cost.estimate`) = ratio; "
             f"{f'{LOW} and {HIGH} blocks per chunk, extrapolated' if args.extrapolate else 'every stage at its real depth'}"
             "; over the device: measured peak above the usable part of the device's memory (`device_bytes`)", "", HEADER]
    print("\n".join(lines), flush=True)
    worst_all, n = 0.0, 0
    rows: dict = {}
    for label, plan, memory_gib in plans(args.skip_published, args.plans):
        t0 = time.perf_counter()
        try:
            got = measured(plan, args.extrapolate)
        except Exception as exc:  # noqa: BLE001  (one plan that cannot be built is reported, the rest go on)
            line = f"| {label} | {_short(plan.parallel)} | error: {type(exc).__name__}: {str(exc)[:160]} | | | | | | |"
        else:
            est = estimated(plan)
            if not args.no_record:
                from bench.calibration.memory_record import put
                put(label, plan, got, args.extrapolate)
            rows[label] = {"parallel": plan.parallel.as_dict(), "measured": got, "estimated": est,
                           "budget": plan.best.budget, "device": device_bytes(plan, memory_gib)}
            if args.json:
                import json
                Path(args.json).write_text(json.dumps(rows, indent=1))
            line = row(label, plan, got, est, memory_gib)
            worst_all = max(worst_all, worst(got, est))
            n += 1
        print(line + f"  <!-- {time.perf_counter() - t0:.0f} s -->", flush=True)
        lines.append(line)
    tail = f"\nWorst |estimate / measured - 1| over {n} plans: {100 * worst_all:.0f}% (goal 10%)"
    print(tail)
    if args.out:
        Path(args.out).write_text("\n".join(lines + [tail]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
