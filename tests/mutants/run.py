"""Apply each mutant of ``catalog/`` in turn and run ``python -m verify all`` against it (every rank
imports a shim ``--module`` file that applies the mutant); a mutant is killed when the run exits 1
(some row failed). Prints one line per mutant (with the first failing row) and the kill rate.

    python -m tests.mutants.run [--sweep default|full] [--mutants NAME ...] [--model M ...] [--op OP ...]
        [--json results.json] [--results tests/mutants/RESULTS.md]

``--sweep default`` (the default) runs the default sample exactly as ``verify all`` does, ``full`` the
whole matrix (``verify all --full``, which runs the default sample's units first, then the rest);
``--model``/``--op`` narrow either for a quick look; ``--precision bf16-mixed`` runs every model row under
that recipe (the bf16 verdict must kill what the float32 one does). The verdict cache is off (``--no-cache``): a mutant
changes what a cached verdict was computed from. Runs stop at the first failing row
(``--no-fail-fast`` runs all). ``bench/verdicts/mutant_kills.py`` prints both sweeps' kill counts.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .catalog import MUTANTS

ROOT = Path(__file__).resolve().parents[2]


def shim(directory: Path, name: str) -> Path:
    """A ``--module`` file that applies mutant ``name`` on import."""
    path = directory / f"mutant_{name}.py"
    catalog = Path(__file__).with_name("catalog")  # a package: its families import ``_base`` relatively
    path.write_text("import importlib.util, sys\n"
                    "mod = sys.modules.get('nnscaler_mutants')\n"
                    "if mod is None:\n"
                    f"    spec = importlib.util.spec_from_file_location('nnscaler_mutants', {str(catalog / '__init__.py')!r},\n"
                    f"                                                  submodule_search_locations=[{str(catalog)!r}])\n"
                    "    mod = importlib.util.module_from_spec(spec)\n"
                    "    sys.modules['nnscaler_mutants'] = mod  # before running it: its relative imports look here\n"
                    "    spec.loader.exec_module(mod)\n"
                    f"    mod.apply({name!r})\n")
    return path


def command(name: str | None, args, tmp: Path) -> list[str]:
    """The ``verify all`` command line of one mutant's run (None: no mutant)."""
    cmd = [sys.executable, "-m", "verify", "all", "--reports", str(tmp / f"reports_{name}"), "--no-cache"]
    cmd += (["--full"] if args.sweep == "full" else []) + (["--op", *args.op] if args.op else []) \
        + (["--model", *args.model] if args.model is not None else []) \
        + (["--precision", args.precision] if args.precision != "32-true" else [])
    if name is not None:
        cmd += ["--module", str(shim(tmp, name))]
    return cmd


def run_one(name: str | None, args, tmp: Path) -> tuple[str, float, str]:
    """(``killed`` | ``survived`` | ``broken``, seconds, the first failing row or the last lines) of
    one mutant (None: no mutant)."""
    cmd = command(name, args, tmp)
    start = time.perf_counter()
    lines: list[str] = []
    killed = False
    reports = tmp / f"reports_{name}"
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:
        reader = threading.Thread(target=lambda: lines.extend(ln.rstrip() for ln in proc.stdout), daemon=True)
        reader.start()  # the output is kept for a broken run; rows are read from cases.jsonl as written
        while proc.poll() is None:
            if args.fail_fast and first_failure(reports):
                killed = True  # the first failing row kills the mutant; stop this run (our own child):
                proc.send_signal(signal.SIGINT)  # an interrupt lets it stop its rank gang cleanly
                break
            time.sleep(0.5)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:  # the run's own session: its forkserver and ranks too, should any outlive it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        reader.join(timeout=5)
    status = "killed" if killed else {0: "survived", 1: "killed"}.get(proc.returncode, "broken")
    tail = first_failure(reports) if status == "killed" else ""
    return status, time.perf_counter() - start, tail or "\n".join(lines[-3:])


def first_failure(reports: Path) -> str:
    """The first failing row of a run's ``cases.jsonl``: ``op W=n partition seed s: status, detail``."""
    try:
        rows = [json.loads(line) for line in (reports / "cases.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return ""
    for r in rows:
        if r.get("status") != "match":
            detail = " ".join(str(r.get("detail", "")).split())[:160]
            return f"{r['op']} W={r['world_size']} {r['partition']} seed {r['seed']}: {r['status']}, {detail}"
    return ""


def write_results(path: str, results: dict[str, tuple[str, float, str]], argv: list[str]) -> None:
    """A markdown table: mutant, verdict, the row that killed it, seconds; then the kill rate."""
    killed = sum(s == "killed" for s, _, _ in results.values())
    lines = ["# Mutation results", "", f"`python -m tests.mutants.run {' '.join(argv)}`".replace("``", ""), "",
             "Each mutant runs alone against `python -m verify all` (the default sample, or `--full` where the "
             "command says `--sweep full`), stopping at the first failing row; `killed by` is that row, `s` the "
             "wall time of the whole run (startup included).", "",
             "| mutant | verdict | killed by (first failing row) | s |", "|---|---|---|---|"]
    for name, (status, secs, row) in results.items():
        row = row.replace("|", "/").replace("\n", " ") if status == "killed" else ""
        lines.append(f"| {name} | {status} | {row} | {secs:.0f} |")
    lines += ["", f"Kill rate: {killed}/{len(results)} = {killed / max(len(results), 1):.0%}.", ""]
    Path(path).write_text("\n".join(lines))


def parser() -> argparse.ArgumentParser:
    """The runner's options (its defaults run ``verify all`` as its README command does)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mutants", nargs="+", default=list(MUTANTS), choices=list(MUTANTS), metavar="NAME")
    ap.add_argument("--sweep", choices=["default", "full"], default="default",
                    help="verify all's default sample, or its whole matrix (--full)")
    ap.add_argument("--model", nargs="*", default=None, help="only these models (default: verify all's)")
    ap.add_argument("--op", nargs="+", default=None, help="only these operators (default: verify all's)")
    ap.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "bf16-true"],
                    help="the recipe every model row runs under (verify all --precision)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run (which must pass)")
    ap.add_argument("--no-fail-fast", dest="fail_fast", action="store_false",
                    help="run every case of a mutant even after its first failing row")
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--results", default=None, metavar="PATH.md", help="write the results table here")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    results: dict[str, tuple[str, float, str]] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if not args.no_baseline:
            status, secs, tail = run_one(None, args, tmp)
            print(f"baseline (no mutant): {'pass' if status == 'survived' else 'FAIL'} in {secs:.0f} s", flush=True)
            if status != "survived":
                print(tail)
                return 2
        for name in args.mutants:
            status, secs, tail = run_one(name, args, tmp)
            results[name] = (status, secs, tail)
            print(f"{name:<40} {status:<9} {secs:6.0f} s", flush=True)
            if status != "survived":
                print("   ", tail.replace("\n", "\n    "), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({n: s for n, (s, _, _) in results.items()}, indent=1))
            if args.results:
                write_results(args.results, results, list(argv if argv is not None else sys.argv[1:]))
    killed = sum(s == "killed" for s, _, _ in results.values())
    print(f"kill rate: {killed}/{len(results)} = {killed / max(len(results), 1):.0%}; survived: "
          f"{', '.join(n for n, (s, _, _) in results.items() if s == 'survived') or 'none'}")
    return 0 if all(s != "broken" for s, _, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
