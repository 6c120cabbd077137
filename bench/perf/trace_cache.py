"""Whole-model cases with the rank's trace cache against tracing every compile afresh.

A whole-model case compiles its model three times (the plan, the checkpoint under another plan, the
resume under plan B), and ``verify all`` runs each model under every policy; with the cache
(``verify/cases/traces.py``) each rank exports a model once per (seed, dtype, argument shapes). Both modes
run the same cases in the same 2-rank process group, alternating, so the ratio stands on a noisy
machine. Every case must match in both modes.

    python bench/perf/trace_cache.py [--models nanogpt llama t5] [--policies dp tp hybrid] [--rounds 2]
"""
from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time
import warnings

import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _rank(rank: int, port: int, models, policies, rounds: int, out) -> None:
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=600))
    import opzoo  # noqa: F401  (the operator catalogue)
    from nnscaler.runtime.mesh import GroupCache, mesh_shapes
    from verify.cases.model import run_model_case
    from verify.cases.traces import TraceCache
    groups = GroupCache(datetime.timedelta(seconds=600))
    groups.create_for_shapes(mesh_shapes(WORLD))
    box = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(box)
    seconds = {"fresh": 0.0, "cached": 0.0}
    for r in range(rounds):
        for mode in (("fresh", "cached") if r % 2 == 0 else ("cached", "fresh")):
            traces = TraceCache() if mode == "cached" else None  # a new cache per round: the first case misses
            for model in models:
                for policy in policies:
                    dist.barrier()
                    t0 = time.perf_counter()
                    checks = run_model_case(model, policy, WORLD, 3, 0, groups, box[0], traces=traces)
                    seconds[mode] += time.perf_counter() - t0
                    bad = [c.name for c in checks if not c.ok]
                    assert not bad, (model, policy, mode, bad[:3])
    if rank == 0:
        out.put(seconds)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["nanogpt", "llama", "t5"])
    p.add_argument("--policies", nargs="+", default=["dp", "tp", "hybrid"])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    from verify.runner.gang import free_port
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(free_port(), args.models, args.policies, args.rounds, out), nprocs=WORLD,
                       start_method="spawn")
    s = out.get()
    cases = len(args.models) * len(args.policies) * args.rounds
    print(f"{cases} whole-model cases per mode at W={WORLD} ({', '.join(args.models)} x {', '.join(args.policies)}, "
          f"{args.rounds} rounds, alternating)")
    print(f"fresh traces: {s['fresh']:.1f} s, trace cache: {s['cached']:.1f} s, "
          f"cached / fresh = {s['cached'] / s['fresh']:.2f}")


if __name__ == "__main__":
    main()
