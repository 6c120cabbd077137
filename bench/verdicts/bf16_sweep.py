"""The bf16 verdict's no-false-alarm sweep: every built-in model trained under ``bf16-mixed`` (or
``--precision bf16-true``) against the single-device run of the same recipe, over 5 seeds, under
``dp`` and ``tp`` at W=2 and ``dp``, ``tp`` and ``hybrid`` at W=4 (``pp`` too on the pipeline models),
each row checking its checkpoint resume as ``verify model`` does. A correct compiler must give zero
MISMATCH; the wrong programs that must still be caught under the same bound are
``tests/harness/test_precision_harness.py`` and ``bench/verdicts/mutant_kills.py --precision bf16-mixed``.

    python bench/verdicts/bf16_sweep.py --out DIR [--models M ...] [--seeds 0 1 2 3 4] [--passes w2 w4]
    python bench/verdicts/bf16_sweep.py --out DIR --table      # tabulate what DIR holds (a run may be resumed)

Each (model, pass) is one ``python -m verify model`` process (its rows in ``DIR/<model>-<pass>.json``,
skipped when present); the table gives per model, world size and policy the statuses over the seeds
and the worst error / bound of the losses and updates (``out``) and of the gradients (``grad``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PASSES = {"w2": (("dp", "tp"), (2,)), "w4": (("dp", "tp", "hybrid"), (4,))}
PIPE = {"w2": "pp", "w4": "pp2_tp"}


def run(out: Path, models, seeds, passes, precision: str) -> None:
    from verify.cases.pipeline import PIPELINE_MODELS
    for p in passes:
        for m in models:
            path = out / f"{m}-{p}.json"
            if path.exists():
                continue
            policies, ws = PASSES[p]
            policies = policies + ((PIPE[p],) if m in PIPELINE_MODELS else ())
            cmd = [sys.executable, "-m", "verify", "model", m, "--policy", *policies, "--world-size", *map(str, ws),
                   "--seed", *map(str, seeds), "--precision", precision, "--json", str(path)]
            print(" ".join(cmd[1:]), flush=True)
            r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if not path.exists():  # refused or crashed before any row: recorded as such
                path.write_text(json.dumps([{"op": f"model:{m}", "world_size": ws[0], "partition": "-",
                                             "status": f"exit {r.returncode}: {r.stderr.strip()[-300:]}"}]))


def table(out: Path) -> str:
    rows = defaultdict(list)
    for f in sorted(out.glob("*.json")):
        for r in json.loads(f.read_text()):
            rows[r["op"].removeprefix("model:"), r["world_size"], r["partition"]].append(r)

    def worst(rs, k):
        v = [r[f"{k}_err"] / r[f"{k}_tol"] for r in rs if r.get(f"{k}_tol")]
        return f"{max(v):.3f}" if v else "-"

    lines = ["| model | W | policy | seeds | statuses | worst loss/update err/tol | worst grad err/tol |",
             "|---|---|---|---|---|---|---|"]
    total = defaultdict(int)
    for (m, w, p), rs in sorted(rows.items()):
        st = defaultdict(int)
        for r in rs:
            st[r["status"]] += 1
            total[r["status"].split(":")[0]] += 1
        seeds = ",".join(str(r["seed"]) for r in rs if "seed" in r)
        lines.append(f"| {m} | {w} | {p} | {seeds} | {', '.join(f'{n} {s}' for s, n in st.items())} | "
                     f"{worst(rs, 'out')} | {worst(rs, 'grad')} |")
    lines.append("")
    lines.append("Total: " + ", ".join(f"{n} {s}" for s, n in sorted(total.items())))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", nargs="*")
    ap.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--passes", nargs="*", choices=list(PASSES), default=list(PASSES))
    ap.add_argument("--precision", default="bf16-mixed", choices=("bf16-mixed", "bf16-true"))
    ap.add_argument("--table", action="store_true", help="only tabulate what --out holds")
    args = ap.parse_args()
    if not args.table:
        from verify.models.registry import MODELS
        import verify.models  # noqa: F401 (registers the built-in models)
        models = args.models or list(MODELS)
        unknown = set(models) - set(MODELS)
        if unknown:
            ap.error(f"unknown model {sorted(unknown)[0]!r}")
        args.out.mkdir(parents=True, exist_ok=True)
        run(args.out, models, args.seeds, args.passes, args.precision)
    print(table(args.out))


if __name__ == "__main__":
    main()
