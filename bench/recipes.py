"""Memory per rank measured (not estimated) and step time of ZeRO stages under ``dp`` at W=4, for
nanoGPT and Llama (``verify.models.megatron``, 4 layers, width 256), in the same processes:

    python bench/recipes.py [--world 4] [--layers 4] [--width 256] [--steps 10]

For each model and zero stage 0, 1, 2 (3 is not built yet): bytes per rank of parameters, gradients
(after backward), optimizer state (after a step) and peak saved activations (saved-tensor hooks
during the forward), each as a ratio against zero 0 of the same run, and the median step time
(forward, backward, optimizer step; the stages' steps interleaved, the order rotating every step, so
machine noise hits each alike) as a ratio against zero 0. Goal: zero 1 and 2 optimizer bytes per rank
~1/W of zero 0's; zero 2 gradient bytes ~1/W.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STAGES = (0, 1, 2)


def _rank(rank: int, world: int, port: int, args, out) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    import opzoo  # noqa: F401
    from nnscaler import ComputeConfig, parallelize
    from verify.cases.memory import SavedActivations, measure, storage_bytes
    from verify.models import megatron

    results = {}
    for name in ("nanogpt", "llama"):
        runs = {}
        with tempfile.TemporaryDirectory() as d:
            for z in STAGES:
                case = getattr(megatron, name)(layers=args.layers, width=args.width, heads=4, seed=0)
                pm = parallelize(case.model, case.batch(0), "dp", ComputeConfig(world, zero=z), verify=False,
                                 gen_savedir=f"{d}/{name}-z{z}")
                runs[z] = (pm, pm.build_optimizer(torch.optim.AdamW, lr=1e-3), case.batch)
            times = {z: [] for z in STAGES}
            mem = {}
            for step in range(args.steps + 2):
                order = STAGES[step % len(STAGES):] + STAGES[:step % len(STAGES)]
                for z in order:
                    pm, opt, batch = runs[z]
                    args_ = batch(step)
                    dist.barrier()
                    t0 = time.perf_counter()
                    saved = SavedActivations(pm.parameters())
                    with saved:
                        loss = pm(*args_)
                    loss.backward()
                    grads = storage_bytes(pm.grad_tensors())
                    opt.step()
                    dist.barrier()
                    if step >= 2:  # two warm-up steps
                        times[z].append(time.perf_counter() - t0)
                    mem[z] = measure(pm, opt, saved.bytes, grads)
                    opt.zero_grad()
        results[name] = {z: dict(mem[z], step_s=statistics.median(times[z])) for z in STAGES}
    out.put((rank, results))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    from verify.runner.gang import free_port
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(_rank, args=(args.world, free_port(), args, out), nprocs=args.world, start_method="spawn")
    by_rank = dict(out.get(timeout=30) for _ in range(args.world))
    print(f"ZeRO under dp at W={args.world}: bytes per rank measured from live tensors (rank 0; max over ranks "
          f"in brackets where it differs), ratio against zero 0 of the same run; step time median of {args.steps}")
    print(f"| model | zero | params | grads | optimizer | saved activations | step ms | params x | grads x | "
          f"optimizer x | activations x | step x |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in by_rank[0]:
        base = by_rank[0][name][0]
        for z in STAGES:
            r = by_rank[0][name][z]
            mx = {k: max(by_rank[q][name][z][k] for q in by_rank) for k in ("params", "grads", "optimizer", "activations")}

            def cell(k):
                return f"{r[k]:,}" + (f" [{mx[k]:,}]" if mx[k] != r[k] else "")

            print(f"| {name} | {z} | {cell('params')} | {cell('grads')} | {cell('optimizer')} | {cell('activations')} | "
                  f"{1e3 * r['step_s']:.1f} | {mx['params'] / base['params']:.3f} | {mx['grads'] / base['grads']:.3f} | "
                  f"{mx['optimizer'] / base['optimizer']:.3f} | {mx['activations'] / base['activations']:.3f} | "
                  f"{r['step_s'] / base['step_s']:.2f} |")


if __name__ == "__main__":
    main()
