"""Train-step time of nnscaler's ``dp`` (and of data-parallel replicas) against ``DistributedDataParallel``, world size 2, same
model and batch, in the same processes (alternating rounds, so machine noise hits both alike).

    python bench/dp_vs_ddp.py [--layers 4] [--width 256] [--batch 8] [--seq 64] [--steps 10]

Goal: ratio (nnscaler / DDP) <= 1.05.
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


def _steps(module, opt, batch, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        loss = module(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rank(rank: int, world: int, port: int, args, out) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    import opzoo  # noqa: F401
    from nnscaler import ComputeConfig, parallelize
    from verify.models.nanogpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=512, block_size=args.seq, n_layer=args.layers, n_head=args.width // 64, n_embd=args.width)
    torch.manual_seed(0)
    base = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    full = (torch.randint(0, 512, (args.batch, args.seq), generator=g), torch.randint(0, 512, (args.batch, args.seq), generator=g))
    local = tuple(x.chunk(world)[rank] for x in full)  # DDP: each rank its share of the same batch
    ddp_model = torch.nn.parallel.DistributedDataParallel(GPT(cfg).requires_grad_(True))
    ddp_model.module.load_state_dict(base.state_dict())
    import copy
    with tempfile.TemporaryDirectory() as d:
        pm = parallelize(copy.deepcopy(base), full, "dp", ComputeConfig(world), gen_savedir=d + "/dp")
        # replicas: a one-rank plan run on every rank, gradients averaged during backward
        rep = parallelize(base, local, "dp", ComputeConfig(1, runtime_ngpus=world), gen_savedir=d + "/rep")
    runs = {"ddp": (ddp_model, local), "nnscaler": (pm, full), "replicas": (rep, local)}
    opts = {k: torch.optim.AdamW(m.parameters()) for k, (m, _) in runs.items()}
    results = {k: [] for k in runs}
    for k, (m, b) in runs.items():
        _steps(m, opts[k], b, 2)
    for _ in range(args.rounds):
        for k, (m, b) in runs.items():
            results[k].append(_steps(m, opts[k], b, args.steps))
    if rank == 0:
        out.put({k: statistics.median(v) for k, v in results.items()})
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from verify.gang import free_port
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(_rank, args=(2, free_port(), args, out), nprocs=2, start_method="spawn")
    r = out.get()
    print(f"GPT {args.layers}x{args.width}, batch {args.batch}x{args.seq}, world size 2 (gloo, CPU): "
          f"DDP {r['ddp'] * 1e3:.1f} ms/step, nnscaler dp {r['nnscaler'] * 1e3:.1f} ms/step, "
          f"ratio {r['nnscaler'] / r['ddp']:.3f}; replicas of a one-rank plan {r['replicas'] * 1e3:.1f} ms/step, "
          f"ratio {r['replicas'] / r['ddp']:.3f} (goal <= 1.05)")


if __name__ == "__main__":
    main()
