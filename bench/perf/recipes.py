"""Memory per rank measured (not estimated) and step time of ZeRO stages and activation recompute
under ``dp`` at W=4, for nanoGPT and Llama (``verify.models.megatron``, 4 layers, width 256), in the
same processes:

    python bench/perf/recipes.py [--world 4] [--layers 4] [--width 256] [--steps 10]

For each model, zero stage 0, 1, 2, 3 and recompute ``none``/``full``: bytes per rank of parameters
(after a step: zero 3 holds its shards only), gradients (after backward), optimizer state (after a
step) and peak saved activations (saved-tensor hooks during the forward, a recomputed block's inputs
included: :class:`nnscaler.runtime.recompute.SavedActivations`), each as a ratio against zero 0 with
no recompute of the same run; ``p+g+o x``: params + grads + optimizer against zero 0's; and the median
step time (forward, backward, optimizer step; the configurations' steps interleaved, the order
rotating every step, so machine noise hits each alike) as a ratio against zero 0 with no recompute.
Goals: zero 3's params + grads + optimizer per rank <= 1/W + 10% of zero 0's (<= 0.275 at W=4);
zero 1/2 optimizer bytes ~1/W; zero 2 gradient bytes ~1/W; full recompute cuts saved activations.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

STAGES = (0, 1, 2, 3)
RECOMPUTE = ("none", "full")
CONFIGS = tuple((z, rc) for z in STAGES for rc in RECOMPUTE)
KEYS = ("params", "grads", "optimizer", "activations")


def _rank(rank: int, world: int, args) -> dict:
    import opzoo  # noqa: F401
    from nnscaler import ComputeConfig, parallelize
    from nnscaler.runtime.recompute import SavedActivations
    from verify.cases.memory import measure, storage_bytes
    from verify.models import megatron

    results = {}
    for name in ("nanogpt", "llama"):
        runs = {}
        with tempfile.TemporaryDirectory() as d:
            for z, rc in CONFIGS:
                case = getattr(megatron, name)(layers=args.layers, width=args.width, heads=4, seed=0)
                pm = parallelize(case.model, case.batch(0), "dp", ComputeConfig(world, zero=z, recompute=rc),
                                 verify=False, gen_savedir=f"{d}/{name}-z{z}-{rc}")
                runs[z, rc] = (pm, pm.build_optimizer(torch.optim.AdamW, lr=1e-3), case.batch)
            times = {c: [] for c in CONFIGS}
            mem = {}
            for step in range(args.steps + 2):
                order = CONFIGS[step % len(CONFIGS):] + CONFIGS[:step % len(CONFIGS)]
                for c in order:
                    pm, opt, batch = runs[c]
                    args_ = batch(step)
                    dist.barrier()
                    t0 = time.perf_counter()
                    with SavedActivations(pm.param_tensors()) as saved:
                        loss = pm(*args_)
                    loss.backward()
                    grads = storage_bytes(pm.grad_tensors())
                    opt.step()
                    dist.barrier()
                    if step >= 2:  # two warm-up steps
                        times[c].append(time.perf_counter() - t0)
                    mem[c] = measure(pm, opt, saved.bytes, grads)
                    opt.zero_grad()
        results[name] = {c: dict(mem[c], step_s=statistics.median(times[c])) for c in CONFIGS}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    from verify.runner.spawn import run_ranks
    by_rank = run_ranks(_rank, args.world, args, timeout_s=3600)
    print(f"ZeRO stages x recompute under dp at W={args.world}: bytes per rank measured from live tensors (rank 0; "
          f"max over ranks in brackets where it differs), ratios (max over ranks) against zero 0 with no recompute "
          f"of the same run; step time median of {args.steps}")
    print("| model | zero | recompute | params | grads | optimizer | saved activations | step ms | p+g+o x | "
          "optimizer x | activations x | step x |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in by_rank[0]:
        base = by_rank[0][name][0, "none"]
        base_pgo = max(sum(by_rank[q][name][0, "none"][k] for k in KEYS[:3]) for q in by_rank)
        for c in CONFIGS:
            r = by_rank[0][name][c]
            mx = {k: max(by_rank[q][name][c][k] for q in by_rank) for k in KEYS}
            pgo = max(sum(by_rank[q][name][c][k] for k in KEYS[:3]) for q in by_rank)

            def cell(k):
                return f"{r[k]:,}" + (f" [{mx[k]:,}]" if mx[k] != r[k] else "")

            print(f"| {name} | {c[0]} | {c[1]} | {cell('params')} | {cell('grads')} | {cell('optimizer')} | "
                  f"{cell('activations')} | {1e3 * r['step_s']:.1f} | {pgo / base_pgo:.3f} | "
                  f"{mx['optimizer'] / base['optimizer']:.3f} | {mx['activations'] / base['activations']:.3f} | "
                  f"{r['step_s'] / base['step_s']:.2f} |")


if __name__ == "__main__":
    main()
