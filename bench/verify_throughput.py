"""Cases per second on the persistent gang against a fresh process group per case.

The baseline is how nnScaler's operator checker works: a new set of ranks (a new ``torchrun``) per
partition. Both run in this process, on the same cases, so the ratio is robust to a noisy machine.
With ``--zoo`` it also times the whole zoo, every partition, at world sizes 2 and 4, gang start
included (the target is under 60 s on a 2-core machine).

    python bench/verify_throughput.py [--ops linear bmm softmax] [--fresh 4] [--zoo]
"""
from __future__ import annotations

import argparse
import tempfile
import time

from verify.cases.config import RunConfig

from verify.sweep import plan_op, run_op
from verify.runner.gang import Gang
from verify.report.writer import ReportWriter
from verify.worker import load_modules


def persistent(specs, cfg: RunConfig) -> tuple[int, float, float]:
    """(cases, seconds including gang start, gang start seconds) on one reused gang."""
    t0 = time.perf_counter()
    with Gang(max(cfg.world_sizes), cfg.modules, cfg.world_sizes) as gang:
        started = time.perf_counter() - t0
        rows = [r for s in specs for r in run_op(gang, s, cfg)]
    assert all(r.ok for r in rows), [r.detail for r in rows if not r.ok]
    return len(rows), time.perf_counter() - t0, started


def fresh(specs, cfg: RunConfig, limit: int, start_method: str) -> tuple[int, float]:
    """(cases, seconds) starting new ranks and a new process group for every case; with ``spawn``
    (fresh interpreters) this is what a per-partition ``torchrun`` does."""
    cases = []
    with Gang(1, cfg.modules, (1,)) as gang:  # list the partitions first; not timed
        for spec in specs:
            plans, failed = plan_op(gang, spec, cfg, cfg.seeds[0])
            assert failed is None, failed.detail
            cases += [(spec, w, label) for w, labels in plans.items() for label in labels]
    t0 = time.perf_counter()
    for spec, w, label in cases[:limit]:
        one = RunConfig(world_sizes=(w,), dtype=cfg.dtype, seeds=cfg.seeds, partition=label, base_override=cfg.base)
        with Gang(w, cfg.modules, (w,), start_method=start_method) as gang:
            rows = list(run_op(gang, spec, one))
        assert all(r.ok for r in rows), [r.detail for r in rows]
    return min(limit, len(cases)), time.perf_counter() - t0


def zoo(cfg: RunConfig) -> tuple[int, float, int]:
    """(cases, seconds, failed) for the whole zoo, gang start included."""
    reg = load_modules(())
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        writer = ReportWriter(d, cfg)
        with Gang(max(cfg.world_sizes), (), cfg.world_sizes) as gang:
            for spec in reg:
                for row in run_op(gang, spec, cfg):
                    writer.add(row)
        writer.close()
        rows = writer.rows
    return len(rows), time.perf_counter() - t0, sum(not r.ok for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", nargs="+", default=["linear", "bmm", "softmax", "layer_norm", "embedding"])
    ap.add_argument("--world-size", type=int, nargs="+", default=[2])
    ap.add_argument("--fresh", type=int, default=4, help="cases to run with a fresh process group each")
    ap.add_argument("--zoo", action="store_true", help="also time the whole zoo at world sizes 2 and 4")
    args = ap.parse_args()
    reg = load_modules(())
    specs = [reg.get(n) for n in args.ops]
    cfg = RunConfig(world_sizes=tuple(args.world_size))
    n_p, t_p, t_start = persistent(specs, cfg)
    per_p = t_p / n_p
    print(f"persistent gang : {n_p} cases in {t_p:.2f} s (gang start {t_start:.2f} s) = {per_p * 1e3:.1f} ms/case, "
          f"{(t_p - t_start) / n_p * 1e3:.1f} ms/case after start")
    for method, what in (("spawn", "fresh interpreters, as torchrun"), ("forkserver", "forked from a warm server")):
        n_f, t_f = fresh(specs, cfg, args.fresh, method)
        per_f = t_f / n_f
        print(f"fresh group/case ({what}): {n_f} cases in {t_f:.2f} s = {per_f * 1e3:.1f} ms/case; "
              f"ratio to persistent {per_f / per_p:.1f}x")
    if args.zoo:
        n, t, bad = zoo(RunConfig(world_sizes=(2, 4)))
        print(f"whole zoo at W=2,4: {n} cases in {t:.1f} s ({n / t:.1f} cases/s), {bad} failed; target < 60 s")


if __name__ == "__main__":
    main()
