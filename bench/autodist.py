"""Plan search time and estimated step time of ``autodist`` for a 24-layer GPT at hidden 2048
(~1.4 B parameters, built on the meta device: no weights allocated) at 8, 16 and 32 ranks on the
H100 profile, against Megatron-LM's hand plan (tensor parallelism 8 inside a node, data parallelism
across nodes: ``hybrid`` with ``tp_size=8``; at 8 ranks that is ``tp``) and plain ``dp``.

    python bench/autodist.py [--worlds 8 16 32] [--batch 8] [--seq 1024] [--budget-gib 40]

Goal: each search under 30 s here; autodist's estimate <= Megatron's (ratio <= 1.0).
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch

import opzoo  # noqa: F401
from nnscaler import ComputeConfig, PlanError
from nnscaler.compile.plan import canonical_params, plan_graph
from nnscaler.cost.summary import human
from nnscaler.trace.build import trace
from verify.models.nanogpt import GPT, GPTConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--budget-gib", type=float, default=40.0)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
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
