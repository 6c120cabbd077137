"""Cluster plans (default) and the per-operator ``autodist`` search (``--operators``).

Cluster (``nnscaler.cluster.search``, H100 profile, bf16-mixed): Llama-3 8B on 8 and 64 GPUs and 70B on
64, 256 and 1024 GPUs at seq 4096 and 8k tokens per GPU per step, planning time including the meta trace,
the chosen configuration and estimated MFU (goal >= 0.40, planning < 60 s each; MFU counts causal attention
at half its scores since context parallelism joined the search, so the same step time reads ~3% lower; where
the search takes cp, the best plan without it follows, and that is the one ``--save`` writes); then for every row of
``nnscaler/cluster/published_runs.csv`` the unconstrained search against the published configuration on the same cost
model (goal: never slower), with the cost model's held-out error on that row and whether the search's claim lies
beyond the evidence (:mod:`nnscaler.cluster.evidence`); every cluster plan prints its evidence lines.

    python bench/calibration/autodist.py [--skip-published] [--save DIR] [--operators] [--long-context] [--measure-memory]

Every plan printed (cluster and published rows) says its memory per rank measured at real width on fake tensors
as on record (``bench/results/real_memory.json``, :mod:`bench.calibration.memory_record`, written by
:mod:`bench.calibration.real_memory`) against today's estimate, or that it has none in this configuration, and a
plan whose measured peak is over the device says so; each table ends with how many are measured and within 10%.
``--measure-memory``: each cluster plan measured now (and recorded).

Long context (``--long-context`` alone, or after the cluster table): Llama-3 8B on 64 and 70B on 512 H100 at
131072 tokens per sequence (32k tokens per GPU per step: 16 and 128 sequences, the latter Llama 3's 16M-token
batch) searched with context parallelism (goal MFU >= 0.38 counting causal attention, within 80 GiB, plan <
60 s including the meta trace), also with Llama 3's all-gather scheme only, with Ulysses only (tp 1: what the
compiler's ``ulysses`` lowers) and without cp; then Llama 3's
long-context configuration (tp 8, cp 16, pp 16, all-gather) as a constraint for 405B on 2048 GPUs (dp 1) and
on 16384 (dp 8, its published row: 38% MFU, held out: never fitted), there also with fused kernels
(``fusion_fused``, as that stack ran) and no memory limit (the published run ran). The searched plans (best,
best with the all-gather scheme, best with Ulysses) are written to ``bench/results/plans_cp/`` (``--save-cp DIR``
elsewhere): ``python -m verify plan`` checks the all-gather and Ulysses ones reduced and refuses a ring plan by
name until the compiler has the ring, so they are not in ``verify/plans/``.

``--save verify/plans`` writes every plan printed (``MODEL-GPUS.json``, ``search-ROW.json``; not the GPT rows,
whose model ``verify plan`` cannot rebuild reduced) where ``verify all`` runs each reduced (a ``plan`` unit,
:mod:`verify.sweep.selection`).

Per-operator (``--operators``): plan search time and estimated step time of ``autodist`` for a 24-layer GPT at hidden 2048
(~1.4 B parameters, built on the meta device: no weights allocated) at 8, 16 and 32 ranks on the
H100 profile, against Megatron-LM's hand plan (tensor parallelism 8 inside a node, data parallelism
across nodes: ``hybrid`` with ``tp_size=8``; at 8 ranks that is ``tp``) and plain ``dp``.

    python bench/calibration/autodist.py [--worlds 8 16 32] [--batch 8] [--seq 1024] [--budget-gib 40]

Goal: each search under 30 s here; autodist's estimate <= Megatron's (ratio <= 1.0).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import opzoo  # noqa: F401,E402
from nnscaler import ComputeConfig, PlanError
from nnscaler.cluster.plan import cp_refusal
from nnscaler.compile.plan import canonical_params, plan_graph
from nnscaler.cost.summary import human
from nnscaler.trace.build import trace
from verify.models.nanogpt import GPT, GPTConfig


LONG_SEQ = 131072
LONG_RUNS = (("llama3-8b", 64, 16), ("llama3-70b", 512, 128))  # (model, GPUs, global batch in sequences)
L3_STAGE = {"tp": 8, "cp": 16, "pp": 16, "cp_scheme": "allgather", "sequence_parallel": True}  # Llama 3's 131k stage
# (Dubey et al. 2024, Table 4; Megatron-style tp with sequence parallelism: a published configuration, priced as run)
L3_RUNS = ((2048, 16, None), (16384, 128, 0.38))  # (GPUs, global batch, published MFU): 16 sequences per dp rank
CP_PLANS_DIR = Path(__file__).resolve().parents[2] / "bench" / "results" / "plans_cp"
PLANS_DIR = Path(__file__).resolve().parents[2] / "verify" / "plans"  # where `--save` keeps them for verify all


def _save(plan, model: str, seq: int, path: Path) -> None:
    """``plan`` as a file ``python -m verify plan`` checks (with the architecture to rebuild it reduced)."""
    from bench.calibration.llama_models import llama_architecture
    plan.model, plan.architecture = model, llama_architecture(model, seq)
    plan.save(path)


def cluster_table(save: str | None = None, measure_memory: bool = False) -> None:
    """Each plan's memory as measured at real width on record (bench/calibration/memory_record.py) against its
    estimate, or why there is none; ``measure_memory``: each plan measured now and recorded (minutes a plan)."""
    from bench.calibration.llama_models import CLUSTER_RUNS, llama_shape
    from nnscaler.cluster.evidence import claims
    from nnscaler.cluster.search import search
    print("cluster plans, H100, bf16-mixed, seq 4096, 8k tokens per GPU per step (goal MFU >= 0.40, plan < 60 s; "
          "the first plan of each model includes its meta trace, the others reuse it)")
    print(f"{'model':<11} {'GPUs':>5} {'plan s':>7} {'MFU':>6} {'step':>8} {'peak/rank':>10}  configuration")
    from bench.calibration.real_memory import memory_line
    from bench.calibration.real_memory import without_cp
    measured_ok: list = []
    shapes: dict = {}
    for name, worlds in CLUSTER_RUNS:
        for w in worlds:
            t0 = time.perf_counter()
            if name not in shapes:
                shapes[name] = llama_shape(name, 4096)
            cfg = ComputeConfig(w, profile="h100", precision="bf16-mixed", global_batch=2 * w)
            plan = search(shapes[name], cfg)
            took = time.perf_counter() - t0
            e = plan.best
            print(f"{name:<11} {w:>5} {took:>6.1f}s {e.mfu:>6.3f} {e.step_seconds:>7.2f}s "
                  f"{human(e.memory['peak']):>10}  {_conf(plan.parallel)}", flush=True)
            for line in claims(plan.profile, w, plan.parallel, e.mfu):
                print(f"{'':<11} {line}")
            label, kept = f"{name}-{w}", without_cp(plan, lambda cons: search(shapes[name], dataclasses.replace(
                cfg, constraints=cons)))  # the plan bench/calibration/real_memory.py measures under this label
            if measure_memory:
                from bench.calibration.fake_stage import measured
                from bench.calibration.memory_record import put
                put(label, kept, measured(kept, extrapolate=True), True)
            line, ratio = memory_line(label, kept)
            print(f"{'':<11} {line}", flush=True)
            measured_ok.append(ratio)
            if cp_refusal(plan.parallel):  # verify plan refuses a cp scheme the compiler lacks: the best plan without cp
                plan = search(shapes[name], dataclasses.replace(cfg, constraints={"cp": 1}))
                e = plan.best
                print(f"{'  no cp':<11} {w:>5} {'':>7} {e.mfu:>6.3f} {e.step_seconds:>7.2f}s "
                      f"{human(e.memory['peak']):>10}  {_conf(plan.parallel)}{'  (saved)' if save else ''}", flush=True)
            if save:  # each plan as a file `python -m verify plan` checks
                _save(plan, name, 4096, Path(save) / f"{name}-{w}.json")
    print(memory_summary(measured_ok))


def memory_summary(ratios: list) -> str:
    """How many plans have their memory measured at real size in their current configuration, how many within
    the goal (10%), and the worst."""
    got = [r for r in ratios if r is not None]
    head = f"memory measured at real size: {len(got)}/{len(ratios)} plans in their current configuration"
    if not got:
        return head
    return (f"{head}, {sum(r <= 0.10 for r in got)} within 10% of the estimate (goal: every plan), worst "
            f"{100 * max(got):.0f}%")


def _conf(p) -> str:
    cp = f" cp{p.cp}-{p.cp_scheme}{'' if p.cp_balanced else '-unbalanced'}" if p.cp > 1 else ""
    return (f"tp{p.tp}{'+sp' if p.sequence_parallel else ''}{cp} pp{p.pp} v{p.virtual_stages} dp{p.dp} "
            f"mbs{p.micro_batch_size} x{p.num_microbatches} zero{p.zero} {p.recompute}")


def long_context_table(save: str | None = None) -> None:
    from bench.calibration.llama_models import llama_shape
    from nnscaler.cluster.search import search
    from nnscaler.profiles import PROFILES
    print(f"\nlong context: seq {LONG_SEQ}, H100, bf16-mixed, MFU counting causal attention at half its scores (goal "
          f"MFU >= 0.38 and peak within the device, plan < 60 s including the meta trace of the first row of a model)")
    print(f"{'model':<11} {'GPUs':>5} {'batch':>5} {'search':<15} {'plan s':>7} {'MFU':>6} {'step':>8} {'cp comm':>8} "
          f"{'peak/rank':>10}  configuration")
    for name, w, gb in LONG_RUNS:
        t0 = time.perf_counter()
        shape = llama_shape(name, LONG_SEQ)
        for label, cons in (("all", {}), ("allgather only", {"cp_scheme": "allgather"}),
                            ("ulysses only", {"cp_scheme": "ulysses", "tp": 1}), ("no cp", {"cp": 1})):
            try:
                plan = search(shape, ComputeConfig(w, profile="h100", precision="bf16-mixed", global_batch=gb,
                                                   constraints=cons))
            except PlanError as exc:  # a row without a plan says why; the other rows stand
                print(f"{name:<11} {w:>5} {gb:>5} {label:<15} no plan: {exc}", flush=True)
                t0 = time.perf_counter()
                continue
            took = time.perf_counter() - t0
            e = plan.best
            print(f"{name:<11} {w:>5} {gb:>5} {label:<15} {took:>6.1f}s {e.mfu:>6.3f} {e.step_seconds:>7.1f}s "
                  f"{e.time['cp_comm']:>7.2f}s {human(e.memory['peak']):>10}  {_conf(plan.parallel)}", flush=True)
            if label != "no cp":  # the best plan, and the best under Llama 3's scheme
                out = Path(save) if save else CP_PLANS_DIR
                out.mkdir(parents=True, exist_ok=True)
                tail = {"all": "", "allgather only": "-allgather", "ulysses only": "-ulysses"}[label]
                _save(plan, name, LONG_SEQ, out / f"{name}-{w}-128k{tail}.json")
            t0 = time.perf_counter()
    print(f"\nLlama 3's long-context stage as a constraint ({', '.join(f'{k} {v}' for k, v in L3_STAGE.items())}), "
          f"llama3-405b at seq {LONG_SEQ}; the rest searched")
    print(f"{'GPUs':>6} {'batch':>5} {'kernels, memory':<22} {'plan s':>7} {'MFU':>6} {'published':>9} {'step':>8} "
          f"{'cp comm':>8} {'peak/rank':>10}  configuration")
    t0 = time.perf_counter()
    shape = llama_shape("llama3-405b", LONG_SEQ)
    h100 = PROFILES["h100"]
    fused = dataclasses.replace(h100, cluster=dataclasses.replace(h100.cluster, fusion=h100.cluster.fusion_fused))
    for w, gb, published in L3_RUNS:
        for label, prof, budget in (("eager, 80 GiB", h100, None), ("fused, no limit", fused, 2**60)):
            if published is None and budget is not None:
                continue
            cfg = ComputeConfig(w, precision="bf16-mixed", global_batch=gb, constraints=L3_STAGE, mem_budget=budget)
            object.__setattr__(cfg, "profile", prof)  # a profile object, as bench/calibration/calibrate.py does
            plan = search(shape, cfg)
            took = time.perf_counter() - t0
            e = plan.best
            print(f"{w:>6} {gb:>5} {label:<22} {took:>6.1f}s {e.mfu:>6.3f} {'' if published is None else published:>9} "
                  f"{e.step_seconds:>7.1f}s {e.time['cp_comm']:>7.2f}s {human(e.memory['peak']):>10}  "
                  f"{_conf(plan.parallel)}", flush=True)
            t0 = time.perf_counter()


def published_table(save: str | None = None) -> None:
    from bench.calibration.calibrate import load_rows, row_search, shapes_for
    from bench.calibration.llama_models import SHAPES
    from bench.calibration.real_memory import memory_line
    from bench.calibration.real_memory import device_bytes, without_cp
    from nnscaler.cluster.evidence import RUNS, claims
    measured_ok: list = []
    rows = load_rows()
    shapes = shapes_for(rows)
    held = {r.name: r.held_out for r in RUNS}
    print("\nunconstrained search vs published configuration (same cost model and memory; goal ratio <= 1.00); "
          "held-out: the cost model's error on that published run when fitted without its source (estimate / "
          "published - 1, bench/results/calibrate_holdout.md): a ratio below 1 by less than it is within the model's "
          "error")
    print(f"{'row':<30} {'published cfg':>13} {'search':>9} {'ratio':>6} {'held-out':>8}  {'never lose':>10}  "
          f"{'evidence':<9} search's configuration")
    wins = 0
    for r in rows:
        shape = shapes[(r["model"], int(r["seq"]))]
        pub, mine = row_search(r, shape)  # the published plan and the search, allowed the memory the run took
        a, b = pub.best.step_seconds, mine.best.step_seconds
        p = mine.parallel
        h = f"{100 * held[r['name']]:+.1f}%" if r["name"] in held else "n/a"
        lines = claims(mine.profile, mine.world, mine.parallel, mine.best.mfu)
        ev = "BEYOND" if any(x.startswith("claim beyond") for x in lines) else \
            "extrap." if "EXTRAPOLATED" in lines[0] else "in range"
        print(f"{r['name']:<30} {a:>12.3f}s {b:>8.3f}s {b / a:>6.2f} {h:>8}  {'yes' if b <= a else 'NO':>10}  {ev:<9} "
              f"{_conf(p)}", flush=True)
        wins += b <= a
        if mine.best.memory["peak"] > device_bytes(mine, float(r["memory_gib"])):  # its budget is the run's, not the device
            print(f"{'':<30} estimated peak {human(mine.best.memory['peak'])}/rank: OVER THE DEVICE "
                  f"({human(device_bytes(mine, float(r['memory_gib'])))} usable), a plan that does not fit", flush=True)
        kept = without_cp(mine, lambda cons: row_search(r, shape, cons=cons)[1])  # as real_memory.py measures it
        line, ratio = memory_line(f"search-{r['name']}", kept, float(r["memory_gib"]))
        print(f"{'':<30} {line}", flush=True)
        measured_ok.append(ratio)
        if save and cp_refusal(mine.parallel):  # verify plan refuses a cp scheme the compiler lacks: the best plan without cp
            mine = row_search(r, shape, cons={"cp": 1})[1]
            print(f"{'  saved without cp':<30} {'':>13} {mine.best.step_seconds:>8.3f}s  {_conf(mine.parallel)}")
        if save and r["model"] in SHAPES:  # a GPT row's model is no transformers model: no reduced rebuild
            _save(mine, r["model"], int(r["seq"]), Path(save) / f"search-{r['name']}.json")
    print("evidence: BEYOND = the search's MFU exceeds the best published run on that device at similar scale by more "
          "than the held-out error (nnscaler.cluster.evidence); extrap. = outside the calibrated range")
    print(f"never lose to the experts: {wins}/{len(rows)} rows (the search's estimate no slower than the published "
          f"configuration's)")
    print(memory_summary(measured_ok))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--operators", action="store_true", help="the per-operator autodist table instead")
    ap.add_argument("--skip-published", action="store_true")
    ap.add_argument("--long-context", action="store_true", help="only the long-context (cp) table")
    ap.add_argument("--save-cp", default=None, metavar="DIR",
                    help=f"where the long-context plans go (default {CP_PLANS_DIR.relative_to(PLANS_DIR.parents[1])})")
    ap.add_argument("--save", default=None, metavar="DIR",
                    help="write each cluster plan as DIR/MODEL-GPUS.json (check one: python -m verify plan FILE)")
    ap.add_argument("--measure-memory", action="store_true",
                    help="measure each cluster plan's peak at real width on fake tensors (bench/calibration/real_memory.py; "
                         "minutes a plan) and print a plan over the device")
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--budget-gib", type=float, default=40.0)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    if args.long_context:
        long_context_table(args.save_cp)
        return
    if not args.operators:
        if args.save:
            Path(args.save).mkdir(parents=True, exist_ok=True)
        cluster_table(args.save, args.measure_memory)
        long_context_table(args.save_cp)
        if not args.skip_published:
            published_table(args.save)
        return
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=50304, block_size=args.seq, n_layer=24, n_head=16, n_embd=2048))
        idx = torch.zeros(args.batch, args.seq, dtype=torch.long)
    t0 = time.perf_counter()
    graph = trace(model, (idx, idx))
    canonical_params(model, graph)
    print(f"GPT 24 x 2048: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, batch {args.batch} x "
          f"{args.seq}; traced once on meta in {time.perf_counter() - t0:.1f} s ({len(graph.ops)} operators)")
    budget = int(args.budget_gib * 2**30)
    print(f"{'W':>3} {'search':>8} {'autodist mesh':<18} {'est. step':>10} {'peak/rank':>10} "
          f"{'Megatron est.':>13} {'peak/rank':>10} {'dp est.':>9} {'ratio':>6}")
    for w in args.worlds:
        t = time.perf_counter()
        try:
            auto = plan_graph(graph, "autodist", ComputeConfig(w, profile="h100", mem_budget=budget))
        except PlanError as exc:
            print(f"{w:>3} {exc}")
            continue
        search = time.perf_counter() - t
        mega = plan_graph(graph, "tp" if w <= 8 else "hybrid", ComputeConfig(w, tp_size=8, profile="h100"))
        dp = plan_graph(graph, "dp", ComputeConfig(w, profile="h100"))
        a, m = auto.stats, mega.stats
        print(f"{w:>3} {search:>7.1f}s {str(auto.mesh_shape) + ' ' + 'x'.join(auto.axis_names):<18} "
              f"{a.step_seconds * 1e3:>8.1f}ms {human(max(a.peak_bytes)):>10} {m.step_seconds * 1e3:>11.1f}ms "
              f"{human(max(m.peak_bytes)):>10} {dp.stats.step_seconds * 1e3:>7.1f}ms "
              f"{a.step_seconds / m.step_seconds:>6.2f}")


if __name__ == "__main__":
    main()
