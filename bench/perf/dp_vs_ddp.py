"""Train-step time of nnscaler's ``dp`` (and of data-parallel replicas) against ``DistributedDataParallel``, world size 2, same
model and batch, in the same processes.

    python bench/perf/dp_vs_ddp.py [--layers 4] [--width 256] [--batch 8] [--seq 64] [--steps 20] [--repeats 3]

Steps of the three runs are interleaved one by one (the order rotating every step), so machine noise
hits each alike; every repeat reports the median over its steps of each run's ratio to the DDP step
next to it, in wall time and in CPU time of the rank process (all its threads, gloo's included: on a
shared machine this is the steadier figure, as it does not count time spent waiting for a core).
Goal: ratio (nnscaler / DDP) <= 1.05.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch
import torch.distributed as dist


def _step(module, opt, batch) -> tuple[float, float]:
    """(wall, CPU) seconds of one train step, ranks in step at both ends."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    loss = module(*batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    dist.barrier()
    return time.perf_counter() - t0, time.process_time() - c0


def _rank(rank: int, world: int, args) -> list:
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
    with tempfile.TemporaryDirectory() as d:
        pm = parallelize(copy.deepcopy(base), full, "dp", ComputeConfig(world), gen_savedir=d + "/dp", verify=False)
        # replicas: a one-rank plan run on every rank, gradients averaged during backward
        rep = parallelize(base, local, "dp", ComputeConfig(1, runtime_ngpus=world), gen_savedir=d + "/rep",
                          verify=False)
    runs = {"ddp": (ddp_model, local), "dp": (pm, full), "replicas": (rep, local)}
    opts = {k: torch.optim.AdamW(m.parameters()) for k, (m, _) in runs.items()}
    names = list(runs)
    for _ in range(2):  # warm up (DDP rebuilds its buckets after its first step)
        for k, (m, b) in runs.items():
            _step(m, opts[k], b)
    repeats = []
    for _ in range(args.repeats):
        times = {k: [] for k in runs}
        for i in range(args.steps):
            for k in names[i % 3:] + names[:i % 3]:
                m, b = runs[k]
                times[k].append(_step(m, opts[k], b))
        ratio = {k: tuple(statistics.median(t[j] / d[j] for t, d in zip(times[k], times["ddp"])) for j in (0, 1))
                 for k in ("dp", "replicas")}
        step = {k: tuple(statistics.median(t[j] for t in v) for j in (0, 1)) for k, v in times.items()}
        repeats.append((ratio, step))
    return repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20, help="steps of each run per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from verify.runner.spawn import run_ranks
    repeats = run_ranks(_rank, 2, args, timeout_s=3600)[0]
    print(f"GPT {args.layers}x{args.width}, batch {args.batch}x{args.seq}, world size 2 (gloo, CPU), "
          f"{args.steps} interleaved steps per repeat; ratio to DDP (median of per-step ratios), wall | CPU:")
    for i, (ratio, step) in enumerate(repeats):
        print(f"  repeat {i}: DDP {step['ddp'][0] * 1e3:.1f} ms/step ({step['ddp'][1] * 1e3:.1f} ms CPU); "
              f"nnscaler dp {ratio['dp'][0]:.3f} | {ratio['dp'][1]:.3f}; "
              f"replicas of a one-rank plan {ratio['replicas'][0]:.3f} | {ratio['replicas'][1]:.3f}")
    for k, label in (("dp", "nnscaler dp"), ("replicas", "replicas")):
        print(f"{label}: median over repeats {statistics.median(r[0][k][0] for r in repeats):.3f} wall, "
              f"{statistics.median(r[0][k][1] for r in repeats):.3f} CPU (goal <= 1.05)")


if __name__ == "__main__":
    main()
