"""Cases per second on the persistent gang against a fresh process group per case.

The baseline is how nnScaler's operator checker works: a new set of ranks (a new ``torchrun``) per
partition. Both run in this process, on the same cases, so the ratio is robust to a noisy machine.
With ``--zoo`` it also times the whole zoo, every partition, at world sizes 2 and 4, gang start
included (the target is under 60 s on a 2-core machine).

With ``--sweep`` it times ``python -m verify all`` as the README runs it, in a clone of this
checkout's last commit: cold (an empty verdict cache), warm (every verdict cached), after touching
one operator family's file (``--touch opzoo/reduction/entries.py``: only that family's units may run again),
and ``--resume`` of the finished run; then where a run's time goes, per phase, against ``--before
DIR`` (the reports of an earlier run, e.g. of ``--full``) when given. With ``--shards N`` it runs the
default sample as N shards one after another, each as a CI machine would (its own clone, cache and
reports), prints each shard's wall time against its share of the recorded unit times, and merges them.

    python bench/perf/verify_throughput.py [--ops linear bmm softmax] [--fresh 4] [--zoo]
    python bench/perf/verify_throughput.py --sweep [--touch opzoo/reduction/entries.py] [--before reports_full/]
    python bench/perf/verify_throughput.py --shards 2
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from verify.config import RunConfig

from verify.rows.run import plan_op, run_op
from verify.runner.gang import Gang
from verify.report.writer import ReportWriter
from verify.runner.worker import load_modules

ROOT = Path(__file__).resolve().parents[2]


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


def phases(report_dir: Path) -> dict[str, float]:
    """Seconds per phase of a ``verify all`` run (from its ``report.json``): operators, each
    policy's plain model cases, micro-batches, pipelines, replicas, recipes, torch's own, and
    start-up and the rest (the run's time less its units')."""
    meta = json.loads((report_dir / "report.json").read_text())
    out: dict[str, float] = {}
    secs = (meta.get("sweep") or {}).get("seconds")
    if secs is None:  # a report from before units: its rows' own times, by the row's kind
        secs = {}
        for r in meta["cases"]:
            label = r["op"] if not r["op"].startswith("model:") else f"{r['op']} {r['partition']}"
            secs[label] = secs.get(label, 0.0) + r["seconds"]
    for label, s in secs.items():
        out[_phase(label)] = out.get(_phase(label), 0.0) + s
    out["start-up and the rest"] = max(meta["seconds"] - sum(secs.values()), 0.0)
    out["total"] = meta["seconds"]
    return out


def _phase(label: str) -> str:
    if label.startswith("torchpar:"):
        return "torch's own parallelizations"
    if not label.startswith("model:"):
        return "operators"
    words = label.split()
    if "bf16-mixed" in words:
        return "recipes"
    if "replicas" in words:
        return "replicas"
    if words[1].startswith("pp"):
        return "pipelines"
    if any(w.startswith("mb") for w in words[2:]):
        return "micro-batches"
    return f"models: {words[1]}"


def _timed(cmd: list[str], cwd: Path) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, env=dict(os.environ, PYTHONPATH=str(cwd)), capture_output=True, text=True)
    if r.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return time.perf_counter() - t0, r.stdout


def sweep(touch: str, before: str | None) -> None:
    """Cold, warm, touched and resumed ``verify all`` in a clone of the last commit; per phase."""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "src"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(src)], check=True)
        run = [sys.executable, "-m", "verify", "all", "--cache-dir", str(Path(d) / "cache")]
        cold, _ = _timed(run + ["--reports", str(Path(d) / "cold")], src)
        warm, _ = _timed(run + ["--reports", str(Path(d) / "warm")], src)
        family = src / touch
        family.write_text(family.read_text() + "\n# touched\n")
        touched, _ = _timed(run + ["--reports", str(Path(d) / "touched")], src)
        now = phases(Path(d) / "cold")  # before the resume rewrites its report
        resumed, _ = _timed(run + ["--reports", str(Path(d) / "cold"), "--resume"], src)
        rows = [json.loads(x) for x in (Path(d) / "touched" / "cases.jsonl").read_text().splitlines()]
        fam = Path(touch).stem
        rerun = {r["op"] for r in rows if not r["cached"]}
        fam_ops = {r["op"] for r in rows if r["family"] == fam}
        print(f"verify all (default sample), wall seconds from a clone: cold {cold:.1f}; warm {warm:.1f} "
              f"({warm / cold:.1%} of cold); after touching {touch} {touched:.1f} ({touched / cold:.1%} of cold, "
              f"{len(rerun)} operators/models ran again: all {len(fam_ops)} of family {fam}: {fam_ops <= rerun}, others: "
              f"{sorted(rerun - fam_ops) or 'none'}); --resume of the finished run {resumed:.1f}")
        then = phases(Path(before)) if before else {}
        print(f"\n| phase | {'before (s) | ' if then else ''}default sample (s) |{' ratio |' if then else ''}")
        print(f"|---|{'---|' if then else ''}---|{'---|' if then else ''}")
        for k in sorted(set(now) | set(then), key=lambda k: (k == "total", k)):
            a, b = then.get(k), now.get(k, 0.0)
            print(f"| {k} | " + (f"{a:.0f} | " if then else "") + f"{b:.0f} |"
                  + (f" {b / a:.2f} |" if then and a else (" - |" if then else "")))


def shards(n: int) -> None:
    """The default sample as ``n`` shards, each in a fresh clone of the last commit with an empty cache,
    one after another (the machine otherwise idle): wall seconds per shard against its predicted share,
    then ``verify merge`` of their reports."""
    from verify.sweep.shard import recorded_times
    with tempfile.TemporaryDirectory() as d:
        walls, cases = [], []
        for i in range(1, n + 1):
            src = Path(d) / f"src{i}"
            subprocess.run(["git", "clone", "-q", str(ROOT), str(src)], check=True)
            wall, out = _timed([sys.executable, "-m", "verify", "all", "--shard", f"{i}/{n}", "--cache-dir",
                                str(Path(d) / f"cache{i}"), "--reports", str(Path(d) / f"r{i}")], src)
            walls.append(wall)
            cases.append(next((x for x in out.splitlines()[::-1] if " cases, " in x), "?"))
        metas = [json.loads((Path(d) / f"r{i}" / "report.json").read_text())["sweep"] for i in range(1, n + 1)]
        merged = subprocess.run([sys.executable, "-m", "verify", "merge", *(str(Path(d) / f"r{i}") for i in
                                                                         range(1, n + 1)),
                                 "--reports", str(Path(d) / "merged")], cwd=Path(d) / "src1",
                                env=dict(os.environ, PYTHONPATH=str(Path(d) / "src1")), capture_output=True, text=True)
    times = recorded_times()  # what the shares were cut by
    predicted = [sum(times.get(label, 0.0) for label in m["units"]) for m in metas]
    print(f"verify all --shard i/{n} (default sample, selection {metas[0]['selection']}, {metas[0]['total']} units), "
          f"each from a fresh clone, cold:")
    print("| shard | predicted (s, recorded unit times) | wall (s) | cases |\n|---|---|---|---|")
    for i in range(n):
        print(f"| {i + 1}/{n} | {predicted[i]:.0f} | {walls[i]:.0f} | {cases[i].strip()} |")
    print(f"slowest / fastest wall: {max(walls) / min(walls):.2f} (goal: within 1.20); "
          f"merge: exit {merged.returncode}, {(merged.stdout.strip().splitlines() or ['?'])[-1]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", nargs="+", default=["linear", "bmm", "softmax", "layer_norm", "embedding"])
    ap.add_argument("--world-size", type=int, nargs="+", default=[2])
    ap.add_argument("--fresh", type=int, default=4, help="cases to run with a fresh process group each")
    ap.add_argument("--zoo", action="store_true", help="also time the whole zoo at world sizes 2 and 4")
    ap.add_argument("--sweep", action="store_true", help="time verify all: cold, warm, touched, resumed; per phase")
    ap.add_argument("--touch", default="opzoo/reduction/entries.py", help="the operator family file --sweep touches")
    ap.add_argument("--before", default=None, metavar="DIR", help="--sweep: reports of an earlier run to compare with")
    ap.add_argument("--shards", type=int, default=0, metavar="N", help="run the default sample as N shards, timed")
    args = ap.parse_args()
    if args.shards:
        shards(args.shards)
        return
    if args.sweep:
        sweep(args.touch, args.before)
        return
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
