"""Compile cost against model size across transformers' zoo: for each architecture (``zoo:<type>``,
``verify.models.zoo``) the traced operators, the seconds of tracing, planning (``dp`` and ``tp`` at
W=2) and code generation (every rank of both plans), and the peak memory of the process that did it.

    python bench/perf/compile_cost.py [--archs mamba kimi_linear ...] [--out bench/results/compile_cost.md]
                                 [--resume [--redo ARCH ...]]

Each architecture compiles in a fresh process (its peak resident memory is its own: ``ru_maxrss``
after the imports is the baseline, the row gives what compiling added). By default the architectures
are those ``reports/zoo.json`` traced plus the state-space and scan-heavy ones of the zoo
(:data:`SCAN`). The summary fits seconds and memory against operators (least squares: a fixed part
and seconds per 1000 operators, with R^2) and lists the rows farthest above the fit: a compiler whose
cost grows with something other than the operators shows up there.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
SCAN = ("mamba", "mamba2", "falcon_mamba", "jamba", "zamba", "zamba2", "bamba", "falcon_h1", "granitemoehybrid",
        "nemotron_h", "rwkv", "kimi_linear", "qwen3_next", "lfm2", "recurrent_gemma", "xlstm")


def one(arch: str) -> dict:
    """The figures of one architecture, in this process."""
    import resource
    import warnings
    warnings.simplefilter("ignore")
    import transformers

    import opzoo  # noqa: F401
    from nnscaler.codegen.emit import generate
    from nnscaler.compile.plan import plan_graph, trace_model
    from nnscaler.config import ComputeConfig
    from verify.models.zoo import build
    transformers.logging.set_verbosity_error()

    def peak_mib() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    row: dict = {"arch": arch}
    case = build(arch)
    args = case.batch(0)
    row["params"] = sum(p.numel() for p in case.model.parameters())
    base = peak_mib()  # imports and the model itself
    t0 = time.perf_counter()
    graph = trace_model(case.model, args, None, registry=None, strict=False)
    row["trace_s"] = time.perf_counter() - t0
    row["ops"] = len(graph.ops)
    row["trace_mib"] = peak_mib() - base
    plans = []
    t0 = time.perf_counter()
    for policy in ("dp", "tp"):
        plans.append(plan_graph(graph, policy, ComputeConfig(WORLD)))
    row["plan_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for plan in plans:
        for rank in range(WORLD):
            generate(graph, plan, rank)
    row["gen_s"] = time.perf_counter() - t0
    row["total_s"] = row["trace_s"] + row["plan_s"] + row["gen_s"]
    row["peak_mib"] = peak_mib() - base
    return row


def measure(arch: str, timeout: float) -> dict:
    """:func:`one` in a fresh process; a failure or timeout is a row with its reason."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", arch]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"arch": arch, "error": f"over {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"arch": arch, "error": tail[:160]}
    return json.loads(lines[-1])


def fit(rows: list[dict], key: str) -> tuple[float, float, float]:
    """(per operator, fixed, R^2) of ``key`` against operators, ordinary least squares (the fixed
    part: what every compile pays once, torch.export's first-call costs among it)."""
    xs, ys = [r["ops"] for r in rows], [r[key] for r in rows]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs) or 1.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    fixed = my - slope * mx
    total = sum((y - my) ** 2 for y in ys) or 1.0
    return slope, fixed, 1 - sum((y - fixed - slope * x) ** 2 for x, y in zip(xs, ys)) / total


def report(rows: list[dict], command: str) -> str:
    ok = sorted((r for r in rows if "error" not in r), key=lambda r: r["ops"])
    s_per, s_fixed, r2_s = fit(ok, "total_s")
    m_per, m_fixed, r2_m = fit(ok, "peak_mib")
    lines = [f"# Compile cost against operators: {len(ok)} architectures of transformers' zoo, W={WORLD}", "",
             f"    {command}", "",
             f"Each row: one fresh process; trace, plan (`dp` and `tp`), generate every rank of both plans. "
             f"Peak memory is what compiling added to the process's peak resident set. Absolute seconds are this "
             f"machine's (2 cores, shared); the fit is the figure to read.", "",
             f"- seconds = {s_fixed:.1f} s + {1000 * s_per:.2f} s per 1000 operators (least squares, R^2 {r2_s:.2f})",
             f"- peak memory = {m_fixed:.0f} MiB + {1000 * m_per:.0f} MiB per 1000 operators (R^2 {r2_m:.2f})",
             f"- largest: {ok[-1]['arch']} ({ok[-1]['ops']} operators): {ok[-1]['total_s']:.1f} s, "
             f"{ok[-1]['peak_mib']:.0f} MiB" if ok else "- no row", "",
             "| arch | params | operators | trace s | plan s | generate s | total s | ms / operator | peak MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in ok:
        lines.append(f"| {r['arch']} | {r['params']} | {r['ops']} | {r['trace_s']:.1f} | {r['plan_s']:.1f} | "
                     f"{r['gen_s']:.1f} | {r['total_s']:.1f} | {1000 * r['total_s'] / r['ops']:.1f} | "
                     f"{r['peak_mib']:.0f} |")
    failed = [r for r in rows if "error" in r]
    if failed:
        lines += ["", "Not compiled (the zoo's own build or trace refuses them; see reports/zoo.md):", ""]
        lines += [f"- {r['arch']}: {r['error']}" for r in failed]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", nargs="+", help="these model types (default: the traced rows of reports/zoo.json "
                                               "and the scan-heavy ones)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per architecture")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "compile_cost.md"))
    ap.add_argument("--resume", action="store_true", help="keep the rows of the --out table's JSON (beside it)")
    ap.add_argument("--redo", nargs="+", default=[], help="with --resume: these architectures afresh")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        sys.path.insert(0, str(ROOT))
        print(json.dumps(one(args.one)), flush=True)
        return
    archs = args.archs
    if not archs:
        zoo = json.loads((ROOT / "reports" / "zoo.json").read_text())
        rows = zoo["rows"] if isinstance(zoo, dict) and "rows" in zoo else zoo
        traced = [a for a, r in rows.items() if r.get("ops")]
        archs = traced + [a for a in SCAN if a not in traced]
    jpath = Path(args.out).with_suffix(".json")
    kept = {r["arch"]: r for r in json.loads(jpath.read_text())} if args.resume and jpath.is_file() else {}
    rows = []
    for arch in archs:
        rows.append(kept[arch] if arch in kept and arch not in args.redo else measure(arch, args.timeout))
        jpath.write_text(json.dumps(rows, indent=1))
        r = rows[-1]
        print(f"{arch:<30} " + (f"{r['ops']:>6} ops {r['total_s']:7.1f} s {r['peak_mib']:7.0f} MiB"
                                if "error" not in r else r["error"]), flush=True)
        Path(args.out).write_text(report(rows, "python bench/perf/compile_cost.py " + " ".join(sys.argv[1:])))


if __name__ == "__main__":
    main()
