"""What isolating each case costs: the per-job state reset, drift check and process-tree sweep of
``verify.runner.isolation`` (plus the parent's liveness/memory poll), as a ratio of one operator case on the
persistent gang, both measured in this run.

    python bench/perf/isolation_overhead.py [--ops linear bmm softmax] [--repeat 2000]
"""
from __future__ import annotations

import argparse
import os
import time

from verify.runner import isolation
from verify.config import RunConfig
from verify.rows.run import run_op
from verify.runner.gang import Gang, rss_tree_mb
from verify.runner.worker import load_modules


def per_job_isolation(repeat: int) -> float:
    """Seconds of reset + drift + child sweep for one job (what every rank does around each job)."""
    cwd = os.getcwd()
    t0 = time.perf_counter()
    for i in range(repeat):
        isolation.reset(i, cwd)
        isolation.drift(cwd)
        isolation.descendants(os.getpid())  # the sweep a rank makes (here without killing our own helpers)
    return (time.perf_counter() - t0) / repeat


def per_poll(repeat: int) -> float:
    """Seconds of one parent poll of one rank (liveness and resident memory of its tree)."""
    pid = os.getpid()
    t0 = time.perf_counter()
    for _ in range(repeat):
        rss_tree_mb(pid)
    return (time.perf_counter() - t0) / repeat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", nargs="+", default=["linear", "bmm", "softmax", "layer_norm", "embedding"])
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    reg = load_modules(())
    cfg = RunConfig(world_sizes=(2,))
    with Gang(2, (), (2,)) as gang:
        for s in args.ops:  # warm up: samples cached, code paths hot
            list(run_op(gang, reg.get(s), cfg))
        t0 = time.perf_counter()
        rows = [r for s in args.ops for r in run_op(gang, reg.get(s), cfg)]
        per_case = (time.perf_counter() - t0) / len(rows)
    iso, poll = per_job_isolation(args.repeat), per_poll(args.repeat)
    print(f"operator case on the gang : {per_case * 1e3:.2f} ms ({len(rows)} cases, all match: {all(r.ok for r in rows)})")
    print(f"isolation per job (rank)  : {iso * 1e3:.3f} ms = {iso / per_case:.3f}x of a case")
    print(f"memory/liveness poll      : {poll * 1e3:.3f} ms per rank per 0.25 s of a case")


if __name__ == "__main__":
    main()
