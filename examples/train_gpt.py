"""Train a small GPT with nnscaler, one process per rank.

    python -m verify.torchrun --nproc_per_node 2 examples/train_gpt.py [--policy dp|tp|hybrid|random|autodist]
        [--steps 10] [--mem-budget-mib N] [--profile cpu-gloo|a100|h100]

(``verify.torchrun`` is torchrun listening on 127.0.0.1 only; plain ``torchrun`` works too, but its
stores listen on every interface.) ``autodist`` searches meshes and partitions with HiGHS for the
fastest plan the cost model of ``--profile`` knows that fits ``--mem-budget-mib`` per rank. Rank 0
prints the plan's one-line summary; the full report is ``plan_report.txt`` next to the generated code.

Runs on CPU (gloo) as it is, and on CUDA (nccl) unchanged when GPUs are present.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import opzoo  # noqa: F401  (the operator catalogue the compiler partitions with)
from nnscaler import ComputeConfig, parallelize
from verify.models.nanogpt import GPT, GPTConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="tp")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--mem-budget-mib", type=float, default=None, help="autodist: memory per rank")
    ap.add_argument("--profile", default=None, help="device profile of the cost model (default cpu-gloo)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial weights on every rank
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
    model = GPT(cfg).to(device)

    def batch(step: int):  # a tiny fixed dataset of 4 batches, so the loss visibly falls
        g = torch.Generator().manual_seed(step % 4)
        x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size + 1), generator=g).to(device)
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()

    sample = batch(0)
    budget = int(args.mem_budget_mib * 2**20) if args.mem_budget_mib else None
    config = ComputeConfig(world, tp_size=2 if world % 2 == 0 else 1, mem_budget=budget, profile=args.profile)
    pm = parallelize(model, sample, args.policy, config, gen_savedir=f".nnscaler/train_gpt_{args.policy}_{world}")
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
    for step in range(args.steps):
        idx, targets = batch(step)
        loss = pm(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
