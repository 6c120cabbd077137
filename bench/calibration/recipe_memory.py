"""The planner's per-rank bytes against the ones measured on real ranks, for every training recipe:
nanoGPT and Llama (``verify.models.megatron``, 4 layers, width 256) at W=4 under ``dp`` over zero
0/1/2/3 x recompute none/selective/full x precision 32-true/bf16-mixed, and under ``hybrid`` (dp 2 x
tp 2) over zero 0/3 x recompute none/full x both precisions:

    python bench/calibration/recipe_memory.py [--world 4] [--layers 4] [--width 256] [--models nanogpt llama]

Estimate: ``nnscaler.plan_model`` with the same ``ComputeConfig`` (no process group):
``plan.stats`` params / grads / optimizer (``nnscaler.cost.estimate.zero_shards``) and saved
activations (``nnscaler.cost.saved``). Measured: one training step on the ranks, the live tensors
after it (params, optimizer state), the gradients after backward, and the storages autograd saved
during the forward (``nnscaler.runtime.recompute.SavedActivations``, a recomputed region's inputs
included), each the max over ranks. Each cell: estimate / measured. Goal: every ratio within 10%.
"""
from __future__ import annotations

import argparse
import tempfile

import torch
import torch.distributed as dist

KEYS = ("params", "grads", "optimizer", "activations")
EST = {"params": "param_bytes", "grads": "grad_bytes", "optimizer": "optim_bytes", "activations": "activation_bytes"}


def configs():
    for prec in ("32-true", "bf16-mixed"):
        for z in (0, 1, 2, 3):
            for rc in ("none", "selective", "full"):
                yield "dp", z, rc, prec
        for z in (0, 3):
            for rc in ("none", "full"):
                yield "hybrid", z, rc, prec


def _rank(rank: int, world: int, args) -> list:
    import opzoo  # noqa: F401
    from nnscaler import ComputeConfig, parallelize, plan_model
    from nnscaler.runtime.recompute import SavedActivations
    from verify.cases.memory import measure, storage_bytes
    from verify.models import megatron

    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name in args.models:
            for k, (policy, z, rc, prec) in enumerate(configs()):
                case = getattr(megatron, name)(layers=args.layers, width=args.width, heads=4, seed=0)
                cfg = ComputeConfig(world, zero=z, recompute=rc, precision=prec)
                est = None
                if rank == 0:
                    stats = plan_model(case.model, case.batch(0), policy, cfg).stats
                    est = {key: max(getattr(stats, EST[key])) for key in KEYS}
                pm = parallelize(case.model, case.batch(0), policy, cfg, verify=False, gen_savedir=f"{d}/{name}{k}")
                opt = pm.build_optimizer(torch.optim.AdamW, lr=1e-3)
                with SavedActivations(pm.param_tensors()) as saved:
                    loss = pm(*case.batch(0))
                loss.backward()
                grads = storage_bytes(pm.grad_tensors())
                opt.step()
                mem = measure(pm, opt, saved.bytes, grads)
                got = [None] * world
                dist.all_gather_object(got, mem)
                rows.append((name, policy, z, rc, prec, est, {key: max(g[key] for g in got) for key in KEYS}))
                del pm, opt, loss
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--models", nargs="*", default=["nanogpt", "llama"], choices=["nanogpt", "llama"])
    args = ap.parse_args()
    from verify.runner.spawn import run_ranks
    rows = run_ranks(_rank, args.world, args, timeout_s=3600)[0]
    print(f"Planner estimate vs measured, bytes per rank (max over the {args.world} ranks), one AdamW step; "
          f"cells: estimate / measured = ratio")
    print("| model | policy | zero | recompute | precision | params | grads | optimizer | saved activations | worst |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    worst_all = 0.0
    for name, policy, z, rc, prec, est, got in rows:
        cells, worst = [], 0.0
        for key in KEYS:
            r = est[key] / got[key] if got[key] else float("nan")
            worst = max(worst, abs(r - 1))
            cells.append(f"{est[key]:,} / {got[key]:,} = {r:.3f}")
        worst_all = max(worst_all, worst)
        print(f"| {name} | {policy} | {z} | {rc} | {prec} | {' | '.join(cells)} | {100 * worst:.1f}% |")
    print(f"\nWorst |estimate / measured - 1| over {len(rows)} recipes x 4 quantities: {100 * worst_all:.1f}% (goal 10%)")


if __name__ == "__main__":
    main()
