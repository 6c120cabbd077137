"""CPU seconds the ranks spend on whole-model cases, this tree against an earlier checkout (``--before DIR``),
run alternately in one session: where the single-device reference runs on rank 0 alone
(``verify/cases/reference.py``), the other ranks no longer compute it.

    python bench/perf/reference_cpu.py --before DIR [--models nanogpt llama] [--policies dp tp] [--world-size 2 4] [--repeat 2]

CPU time (user + system of every rank, from ``/proc``) is the figure: this machine is shared, and wall
time of a case moves with the load of others' jobs; the wall seconds are printed beside it."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def child(args) -> None:
    """Run the cases on a gang of this interpreter's tree; print one JSON line per case."""
    from verify.runner.gang import Gang
    with tempfile.TemporaryDirectory() as gen, Gang(max(args.world_size), (), tuple(args.world_size)) as gang:
        for model in args.models:
            for policy in args.policies:
                for w in args.world_size:
                    job = {"kind": "model", "model": model, "policy": policy, "world_size": w, "steps": 3, "seed": 0,
                           "gen_dir": gen, "dtype": "float32", "checkpoint": True}
                    before, t = [_cpu(p) for p in gang.pids], time.perf_counter()
                    answers = gang.run(job, w, 900)
                    wall, cpu = time.perf_counter() - t, sum(_cpu(p) for p in gang.pids) - sum(before)
                    ok = all(a.result and not a.result.get("error") for a in answers)
                    print(json.dumps({"case": f"{model} {policy} W={w}", "w": w, "cpu": cpu, "wall": wall, "ok": ok}), flush=True)


def measure(tree: Path, args) -> list[dict]:
    cmd = [sys.executable, __file__, "--child", "--models", *args.models, "--policies", *args.policies,
           "--world-size", *map(str, args.world_size)]
    out = subprocess.run(cmd, cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)), capture_output=True, text=True)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not rows:
        sys.exit(f"{tree}: the cases did not run ({out.stderr.strip().splitlines()[-1:]})")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, help="an earlier checkout to compare with")
    p.add_argument("--models", nargs="+", default=["nanogpt", "llama"])
    p.add_argument("--policies", nargs="+", default=["dp", "tp"])
    p.add_argument("--world-size", nargs="+", type=int, default=[2, 4])
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    if args.before is None:
        p.error("--before DIR: an earlier checkout to compare with")
    runs = {"before": [], "after": []}
    for _ in range(args.repeat):  # alternately, so both see the same load
        runs["before"].append(measure(args.before.resolve(), args))
        runs["after"].append(measure(ROOT, args))
    print("| case | CPU s before | CPU s after | after/before | wall s before | wall s after |")
    print("|---|---|---|---|---|---|")
    total: dict = {}
    for i, row in enumerate(runs["before"][0]):
        b = [r[i] for r in runs["before"]]
        a = [r[i] for r in runs["after"]]
        cb, ca = sum(x["cpu"] for x in b) / len(b), sum(x["cpu"] for x in a) / len(a)
        wb, wa = sum(x["wall"] for x in b) / len(b), sum(x["wall"] for x in a) / len(a)
        for key in (f"W={row['w']}", "all"):
            t = total.setdefault(key, [0.0, 0.0, 0.0, 0.0])
            t[0], t[1], t[2], t[3] = t[0] + cb, t[1] + ca, t[2] + wb, t[3] + wa
        flag = "" if all(x["ok"] for x in a + b) else " (a rank raised)"
        print(f"| {row['case']}{flag} | {cb:.1f} | {ca:.1f} | {ca / cb:.2f} | {wb:.1f} | {wa:.1f} |")
    for key, (cb, ca, wb, wa) in total.items():
        print(f"| **{key}** | {cb:.1f} | {ca:.1f} | **{ca / cb:.2f}** | {wb:.1f} | {wa:.1f} |")


if __name__ == "__main__":
    main()
