"""Cluster plans (default) and the per-operator ``autodist`` search (``--operators``).

Cluster (``nnscaler.cluster.search``, H100 profile, bf16-mixed): Llama-3 8B on 8 and 64 GPUs and 70B on
64, 256 and 1024 GPUs at seq 4096 and 8k tokens per GPU per step, planning time including the meta trace,
the chosen configuration and estimated MFU (goal >= 0.40, planning < 60 s each); then for every row of
``bench/published_runs.csv`` the unconstrained search against the published configuration on the same cost
model (goal: never slower), with the cost model's held-out error on that row and whether the search's claim lies
beyond the evidence (:mod:`nnscaler.cluster.evidence`); every cluster plan prints its evidence lines.

    python bench/calibration/autodist.py [--skip-published] [--save DIR] [--operators]

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
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import opzoo  # noqa: F401,E402
from nnscaler import ComputeConfig, PlanError
from nnscaler.compile.plan import canonical_params, plan_graph
from nnscaler.cost.summary import human
from nnscaler.trace.build import trace
from verify.models.nanogpt import GPT, GPTConfig


CLUSTER_RUNS = (("llama3-8b", (8, 64)), ("llama3-70b", (64, 256, 1024)))  # (model, GPU counts) of the table
PLANS_DIR = Path(__file__).resolve().parents[2] / "verify" / "plans"  # where `--save` keeps them for verify all


def _save(plan, model: str, seq: int, path: Path) -> None:
    """``plan`` as a file ``python -m verify plan`` checks (with the architecture to rebuild it reduced)."""
    from bench.calibration.llama_models import llama_architecture
    plan.model, plan.architecture = model, llama_architecture(model, seq)
    plan.save(path)


def cluster_table(save: str | None = None) -> None:
    from bench.calibration.llama_models import llama_shape
    from nnscaler.cluster.evidence import claims
    from nnscaler.cluster.search import search
    print("cluster plans, H100, bf16-mixed, seq 4096, 8k tokens per GPU per step (goal MFU >= 0.40, plan < 60 s; "
          "the first plan of each model includes its meta trace, the others reuse it)")
    print(f"{'model':<11} {'GPUs':>5} {'plan s':>7} {'MFU':>6} {'step':>8} {'peak/rank':>10}  configuration")
    shapes: dict = {}
    for name, worlds in CLUSTER_RUNS:
        for w in worlds:
            t0 = time.perf_counter()
            if name not in shapes:
                shapes[name] = llama_shape(name, 4096)
            plan = search(shapes[name], ComputeConfig(w, profile="h100", precision="bf16-mixed", global_batch=2 * w))
            took = time.perf_counter() - t0
            if save:  # each plan as a file `python -m verify plan` checks
                _save(plan, name, 4096, Path(save) / f"{name}-{w}.json")
            p, e = plan.parallel, plan.best
            print(f"{name:<11} {w:>5} {took:>6.1f}s {e.mfu:>6.3f} {e.step_seconds:>7.2f}s "
                  f"{human(e.memory['peak']):>10}  tp{p.tp}{'+sp' if p.sequence_parallel else ''} pp{p.pp} "
                  f"v{p.virtual_stages} dp{p.dp} mbs{p.micro_batch_size} x{p.num_microbatches} zero{p.zero} "
                  f"{p.recompute}", flush=True)
            for line in claims(plan.profile, w, p, e.mfu):
                print(f"{'':<11} {line}")


def published_table(save: str | None = None) -> None:
    from bench.calibration.calibrate import config, load_rows, partly_published, shapes_for
    from bench.calibration.llama_models import SHAPES
    from nnscaler.cluster.evidence import RUNS, claims
    from nnscaler.cluster.search import search
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
        pub = search(shape, config(r, fit_memory=partly_published(r)), r["model"])  # as bench/calibration/calibrate.py
        # the published run ran: the search may use as much memory as our estimate of it says it took
        budget = max(int(0.9 * float(r["memory_gib"]) * 2**30), int(pub.best.memory["peak"]))
        mine = search(shape, config(r, cons={}, budget=budget), r["model"])
        a, b = pub.best.step_seconds, mine.best.step_seconds
        p = mine.parallel
        h = f"{100 * held[r['name']]:+.1f}%" if r["name"] in held else "n/a"
        lines = claims(mine.profile, mine.world, mine.parallel, mine.best.mfu)
        ev = "BEYOND" if any(x.startswith("claim beyond") for x in lines) else \
            "extrap." if "EXTRAPOLATED" in lines[0] else "in range"
        print(f"{r['name']:<30} {a:>12.3f}s {b:>8.3f}s {b / a:>6.2f} {h:>8}  {'yes' if b <= a else 'NO':>10}  {ev:<9} "
              f"tp{p.tp}{'+sp' if p.sequence_parallel else ''} pp{p.pp} v{p.virtual_stages} dp{p.dp} "
              f"mbs{p.micro_batch_size} x{p.num_microbatches} zero{p.zero} {p.recompute}", flush=True)
        wins += b <= a
        if save and r["model"] in SHAPES:  # a GPT row's model is no transformers model: no reduced rebuild
            _save(mine, r["model"], int(r["seq"]), Path(save) / f"search-{r['name']}.json")
    print("evidence: BEYOND = the search's MFU exceeds the best published run on that device at similar scale by more "
          "than the held-out error (nnscaler.cluster.evidence); extrap. = outside the calibrated range")
    print(f"never lose to the experts: {wins}/{len(rows)} rows (the search's estimate no slower than the published "
          f"configuration's)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--operators", action="store_true", help="the per-operator autodist table instead")
    ap.add_argument("--skip-published", action="store_true")
    ap.add_argument("--save", default=None, metavar="DIR",
                    help="write each cluster plan as DIR/MODEL-GPUS.json (check one: python -m verify plan FILE)")
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--budget-gib", type=float, default=40.0)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    if not args.operators:
        if args.save:
            Path(args.save).mkdir(parents=True, exist_ok=True)
        cluster_table(args.save)
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
