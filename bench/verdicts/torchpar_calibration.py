"""How close correct torch parallelizations come to the bounds: the worst ratio err / tol (1.0 = at
the bound) of each row's reported checks (loss, gradients, updates, DCP resume) for every built-in
correct case of ``verify all``'s torchpar section (``verify/rows/torchpar_builtin.py``), over seeds.
One rank gang serves every case.

    python bench/verdicts/torchpar_calibration.py [--seeds 1 2 3] [--steps 3]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's packages, not an installed copy

from verify.config import RunConfig  # noqa: E402
from verify.rows.torchpar_builtin import CASES  # noqa: E402
from verify.cases.torchpar.mesh import parse_mesh  # noqa: E402
from verify.rows.torchpar import run_torchpar  # noqa: E402
from verify.judge.verdict import MATCH  # noqa: E402
from verify.runner.gang import Gang  # noqa: E402


def ratio(err, tol) -> float:
    return 0.0 if not err else (err / tol if tol else float("inf"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    cases = [c for c in CASES if c.expect == MATCH]
    sizes = sorted({c.world_size for c in cases})
    rows = []
    start = time.perf_counter()
    with Gang(max(sizes), world_sizes=sizes) as gang, tempfile.TemporaryDirectory() as tmp:
        for c in cases:
            cfg = RunConfig(world_sizes=(c.world_size,), seeds=tuple(args.seeds))
            for row in run_torchpar(gang, c.model, c.plan, parse_mesh(c.mesh), cfg, tmp, steps=args.steps):
                r = max(ratio(row.out_err, row.out_tol), ratio(row.grad_err, row.grad_tol))
                rows.append((c.name, c.world_size, row.seed, row.status, r))
    print("| case | W | seed | status | worst err/tol |\n|---|---|---|---|---|")
    for name, w, seed, status, r in rows:
        print(f"| {name} | {w} | {seed} | {status} | {r:.3f} |")
    bad = [r for r in rows if r[3] != MATCH]
    print(f"\n{len(rows)} cases, {len(bad)} not matching, worst err/tol {max(r[4] for r in rows):.3f}, "
          f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
