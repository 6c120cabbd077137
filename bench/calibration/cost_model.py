"""Does the cost model rank plans like reality? Estimated (``Plan.stats``, profile ``cpu-gloo``) vs
measured train-step time of one GPT under many plans (dp, tp, hybrid, autodist under a budget, and
seeded random plans) at world sizes 2 and 4 on real gloo ranks here; prints each pair and the
Spearman rank correlation.

    python bench/calibration/cost_model.py [--layers 2] [--width 128] [--batch 8] [--seq 64] [--steps 8] [--seeds 3]

Goal: Spearman >= 0.8.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist

from verify.runner.spawn import run_ranks


def spearman(a, b) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(x):
        x = np.asarray(x, float)
        order = x.argsort()
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for v in np.unique(x):  # ties share their mean rank
            r[x == v] = r[x == v].mean()
        return r
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def _plans(world: int, seeds: int) -> list[tuple[str, int]]:
    out = [("dp", 0), ("tp", 0)] + [("random", s) for s in range(seeds)]
    if world >= 4:
        out += [("hybrid", 0), ("autodist_tight", 0)]
    return out


def _rank(rank: int, world: int, args) -> list:
    import opzoo  # noqa: F401
    from nnscaler import ComputeConfig, parallelize
    from nnscaler.cost.estimate import analyze
    from nnscaler.profiles import get_profile
    from nnscaler.policies import POLICIES, autodist
    from verify.models.nanogpt import GPT, GPTConfig

    def autodist_tight(graph, config):  # autodist under 3/4 of dp's memory: it must shard something
        dp = POLICIES["dp"](graph, config)
        budget = int(0.75 * max(analyze(graph, dp, get_profile(config.profile)).peak_bytes))
        return autodist(graph, replace(config, mem_budget=budget))

    cfg = GPTConfig(vocab_size=512, block_size=args.seq, n_layer=args.layers, n_head=args.width // 32, n_embd=args.width)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 512, (args.batch, args.seq), generator=g), torch.randint(0, 512, (args.batch, args.seq), generator=g))
    runs = []
    for policy, seed in _plans(world, args.seeds):
        torch.manual_seed(0)
        model = GPT(cfg)
        fn = autodist_tight if policy == "autodist_tight" else policy
        with tempfile.TemporaryDirectory() as d, contextlib.redirect_stdout(io.StringIO()):
            pm = parallelize(model, batch, fn, ComputeConfig(world, tp_size=2, seed=seed), gen_savedir=d)
        runs.append((policy, seed, pm, torch.optim.AdamW(pm.parameters()), []))
    for round_ in range(args.steps + 2):  # rounds over all plans: machine noise hits them alike
        for policy, seed, pm, opt, times in runs:
            dist.barrier()
            t0 = time.perf_counter()
            pm(*batch).backward()
            opt.step()
            opt.zero_grad()
            dist.barrier()
            if round_ >= 2:  # the first rounds warm up allocators and gloo
                times.append(time.perf_counter() - t0)
    rows = [{"world": world, "policy": policy, "seed": seed, "mesh": list(pm.plan.mesh_shape),
             "estimated_s": pm.plan.stats.step_seconds, "measured_s": min(times)}
            for policy, seed, pm, opt, times in runs]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for world in (2, 4):
        rows += run_ranks(_rank, world, args, timeout_s=3600)[0]
    print(f"{'W':>2} {'policy':<15} {'seed':>4} {'mesh':<8} {'estimated':>10} {'measured':>10}")
    for r in rows:
        print(f"{r['world']:>2} {r['policy']:<15} {r['seed']:>4} {str(tuple(r['mesh'])):<8} "
              f"{r['estimated_s'] * 1e3:>8.2f}ms {r['measured_s'] * 1e3:>8.2f}ms")
    rho = spearman([r["estimated_s"] for r in rows], [r["measured_s"] for r in rows])
    print(f"plans: {len(rows)}; Spearman rank correlation estimated vs measured: {rho:.3f} (goal >= 0.8)")


if __name__ == "__main__":
    main()
