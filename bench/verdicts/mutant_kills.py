"""Kill counts of the mutant catalogue (``tests/mutants``) under ``verify all``'s default sample and
under its whole matrix (``--full``): the default sample must kill every mutant the full one does.

    python bench/verdicts/mutant_kills.py [--mutants NAME ...] [--out bench/results/mutant_kills.md]
    python bench/verdicts/mutant_kills.py --precision bf16-mixed --sweeps default [--model M ...] [--mutants NAME ...]
    python bench/verdicts/mutant_kills.py --harness [--mutants NAME ...]

``--harness`` runs the harness mutant catalogue (``tests/mutants/harness``) instead: each mutant applied alone
(in pytest and in every rank) with the tests it names as its killers (``tests/mutants/harness_run.py``),
printing each with its killing test, killed/survived and seconds, into
``bench/results/harness_mutant_kills.md``.

Each mutant runs alone through ``tests/mutants/run.py`` (fail-fast: a run stops at its first failing
row) once per sweep; the table gives each sweep's verdict, first failing row and wall seconds.

``--full`` runs the default sample's units first, in the same order and each with its checkpoint
resume (the same training, more checks; ``verify.sweep.selection.full_order``, pinned by
``tests/harness/test_selection.py``), so a mutant the default kills at a unit dies at that unit under
``--full`` too. Its full verdict is therefore derived (``killed*``, no run) unless
``--measure-full`` asks for the run; a mutant the default misses always gets its full run, the one
case where the two sweeps can differ.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.mutants.catalog import MUTANTS  # noqa: E402
from tests.mutants.run import parser as run_parser, run_one  # noqa: E402


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--harness" in argv:
        from tests.mutants import harness_run  # noqa: PLC0415
        rest = [a for a in argv if a != "--harness"]
        if "--results" not in rest:
            rest += ["--results", str(ROOT / "bench" / "results" / "harness_mutant_kills.md")]
        return harness_run.main(rest)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--harness", action="store_true", help="the harness mutant catalogue instead (see above)")
    ap.add_argument("--mutants", nargs="+", default=list(MUTANTS), choices=list(MUTANTS), metavar="NAME")
    ap.add_argument("--sweeps", nargs="+", default=["default", "full"], choices=["default", "full"])
    ap.add_argument("--out", default=None, help="default: bench/results/mutant_kills[_PRECISION].md")
    ap.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "bf16-true"],
                    help="run every model row under this recipe (the bf16 verdict must kill what fp32 does)")
    ap.add_argument("--model", nargs="+", default=None, help="only these models (verify all --model)")
    ap.add_argument("--report-only", action="store_true", help="write the table of what the partial record holds")
    ap.add_argument("--measure-full", action="store_true",
                    help="run --full for mutants the default kills too (else their full verdict is derived)")
    args = ap.parse_args(argv)
    results: dict[str, dict[str, tuple[str, float, str]]] = {}
    tag = "" if args.precision == "32-true" else "_" + args.precision.replace("-", "_")
    out = Path(args.out or ROOT / "bench" / "results" / f"mutant_kills{tag}.md")
    partial = out.with_suffix(".json")
    if partial.exists():  # an interrupted run goes on where it stopped
        results = {m: {s: tuple(v) for s, v in d.items()} for m, d in json.loads(partial.read_text()).items()}
    with tempfile.TemporaryDirectory() as d:
        for name in ([] if args.report_only else args.mutants):
            for sweep in args.sweeps:
                if sweep in results.get(name, {}):
                    continue
                done = results.get(name, {}).get("default")
                if sweep == "full" and done and done[0] == "killed" and not args.measure_full:
                    results[name]["full"] = ("killed*", 0.0, done[2])  # the default's unit runs first under --full
                    continue
                opts = run_parser().parse_args(["--sweep", sweep, "--precision", args.precision]
                                               + (["--model", *args.model] if args.model else []))
                status, secs, row = run_one(name, opts, Path(d))
                results.setdefault(name, {})[sweep] = (status, secs, row if status == "killed" else "")
                print(f"{name:<42} {sweep:<8} {status:<9} {secs:6.0f} s  {row[:100] if status == 'killed' else ''}",
                      flush=True)
                partial.write_text(json.dumps(results, indent=1))
    counts = {s: sum(results[m].get(s, ("",))[0] in ("killed", "killed*") for m in results) for s in args.sweeps}
    derived = sum(results[m].get("full", ("",))[0] == "killed*" for m in results)
    ran = {s: sum(s in results[m] for m in results) for s in args.sweeps}
    lines = ["# Mutant kill counts: default sample vs --full", "",
             "`python bench/verdicts/mutant_kills.py`: each mutant of `tests/mutants/catalog` applied alone, then `python -m "
             "verify all` (default sample) and `python -m verify all --full` (whole matrix), each stopping at its "
             "first failing row (`tests/mutants/run.py`).", "",
             ", ".join(f"**{s}: {counts[s]}/{ran[s]} killed**" for s in args.sweeps)
             + (f" (full: {derived} of them `killed*`, derived from the default's kill: `--full` runs the default's "
                f"units first, in the same order; the rest measured)" if derived else ""), "",
             "| mutant | " + " | ".join(f"{s} | {s} s | {s}: first failing row" for s in args.sweeps) + " |",
             "|---|" + "---|---|---|" * len(args.sweeps)]
    if tag:
        lines[0] += f", every model row under {args.precision}"
        lines[2] = (f"`python bench/verdicts/mutant_kills.py --precision {args.precision}"
                    + (f" --model {' '.join(args.model)}" if args.model else "") + f" --sweeps {' '.join(args.sweeps)}`: "
                    "as below, each `verify all` run with `--precision`; operator rows are not affected by it.")
    missing = [m for m in MUTANTS if m not in results]
    if missing:
        lines[5:5] = [f"Not run yet ({len(missing)} of {len(MUTANTS)}): {', '.join(missing)}.", ""]
    for m, per in results.items():
        cells = []
        for s in args.sweeps:
            st, secs, row = per.get(s, ("not run", 0.0, ""))
            cells += [st, f"{secs:.0f}", row.replace("|", "/").replace("\n", " ")[:140]]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    out.write_text("\n".join(lines) + "\n")
    print(", ".join(f"{s}: {counts[s]}/{ran[s]} killed" for s in args.sweeps) + (f" ({derived} derived)" if derived else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
