"""How close correct programs come to the whole-model bounds: the worst ratio err / tol per kind of
check (loss, gradient, parameter update, checkpoint) over models, widths, seeds, policies and world
sizes. A ratio near 1 would be a false alarm waiting to happen; the perturbation tests in
``tests/test_model_verdict.py`` show that 1e-4 relative errors land far above 1.

    python bench/verdict_calibration.py [--models nanogpt transformer_encoder] [--widths 32 128 256]
        [--seeds 0 1 2 3 4 5 6 7 8 9] [--policies dp tp] [--world-size 2] [--steps 3]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict

from verify.cases import judge
from verify.gang import Gang
from verify.model_case import expected_checks


def kind(name: str) -> str:
    return name.split()[0] if not name.startswith("loss of") else "checkpoint"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["nanogpt", "transformer_encoder", "bucketed_mlp"])
    ap.add_argument("--widths", type=int, nargs="+", default=[32, 128, 256])
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    ap.add_argument("--policies", nargs="+", default=["dp", "tp"])
    ap.add_argument("--world-size", type=int, nargs="+", default=[2])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    worst: dict[str, tuple[float, str]] = defaultdict(lambda: (0.0, ""))
    failed, cases, t0 = [], 0, time.perf_counter()
    with Gang(max(args.world_size), (), args.world_size) as gang, tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for width in args.widths:
                name = f"{model}@{width}"
                for seed in args.seeds:
                    for w in args.world_size:
                        for policy in args.policies:
                            job = {"kind": "model", "model": name, "policy": policy, "world_size": w,
                                   "steps": args.steps, "seed": seed, "gen_dir": tmp, "dtype": args.dtype}
                            status, detail, checks, _ = judge(gang.run(job, w, 600),
                                                              expected_checks(name, policy, args.steps, seed))
                            cases += 1
                            where = f"{name} {policy} W={w} seed {seed}"
                            if status != "match":
                                failed.append(f"{where}: {status} {detail}")
                                print("  FAILED", failed[-1], flush=True)
                            for c in checks:
                                r = c["err"] / c["tol"] if c["tol"] > 0 else (0.0 if c["err"] == 0 else float("inf"))
                                if r > worst[kind(c["name"])][0]:
                                    worst[kind(c["name"])] = (r, f"{where}: {c['name']}")
                print(f"{name}: {cases} cases so far, {len(failed)} failed, {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"\n{cases} cases, {len(failed)} not matching, {time.perf_counter() - t0:.0f} s")
    print("worst err/tol per kind of check (1.0 = at the bound):")
    for k, (r, where) in sorted(worst.items()):
        print(f"  {k:<12} {r:8.3f}  {where}")


if __name__ == "__main__":
    main()
