"""Apply each harness mutant (``tests/mutants/harness``) alone and run the tests it names as its killers
(``python -m pytest -p tests.mutants.harness_plugin --harness-mutant NAME NODEID...``); a mutant is killed
when those tests fail. Prints one line per mutant (killing test, killed/survived, seconds) and the kill rate.

    python -m tests.mutants.harness_run [--mutants NAME ...] [--results PATH.md] [--timeout S] [--fast]

Each mutant runs in a pytest process of its own; ``--fast`` runs them all in this one process instead, one
``pytest.main`` after another (the mutant applied at configure, undone at unconfigure; rank gangs and forked
ranks still get it), saving pytest's and torch's start per mutant.

``bench/verdicts/mutant_kills.py --harness`` runs it and writes ``bench/results/harness_mutant_kills.md``."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .harness import HARNESS

ROOT = Path(__file__).resolve().parents[2]


def command(name: str, kills: tuple[str, ...]) -> list[str]:
    """The pytest command line that runs ``kills`` with harness mutant ``name`` applied."""
    return [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:xdist", "-p", "no:cacheprovider",
            "-p", "tests.mutants.harness_plugin", "--harness-mutant", name, *kills]


def run_one(name: str, timeout: float = 900.0) -> tuple[str, float, str]:
    """(``killed`` | ``survived`` | ``broken``, seconds, the last line of pytest's output) of one mutant."""
    m = HARNESS[name]
    start = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    with subprocess.Popen(command(name, m.kills), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=env, start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # our own child's session: pytest and its ranks
            out, _ = proc.communicate()
            return "broken", time.perf_counter() - start, f"timed out after {timeout:.0f} s"
    status = {0: "survived", 1: "killed"}.get(proc.returncode, "broken")
    last = [ln for ln in out.splitlines() if ln.strip()]
    return status, time.perf_counter() - start, (last[-1] if last else f"exit {proc.returncode}")


def run_here(name: str) -> tuple[str, float, str]:
    """:func:`run_one` in this process (``--fast``)."""
    import pytest  # noqa: PLC0415

    from .harness_plugin import Applied  # noqa: PLC0415
    start = time.perf_counter()
    rc = pytest.main(["-q", "-x", "-p", "no:xdist", "-p", "no:cacheprovider", *HARNESS[name].kills],
                     plugins=[Applied(name)])
    status = {0: "survived", 1: "killed"}.get(int(rc), "broken")
    return status, time.perf_counter() - start, f"exit {int(rc)}"


def write_results(path: str | Path, results: dict[str, tuple[str, float, str]], argv: list[str]) -> None:
    """A markdown table: mutant, target, killing test(s), verdict, seconds; then the kill rate."""
    killed = sum(s == "killed" for s, _, _ in results.values())
    missing = [n for n in HARNESS if n not in results]
    lines = ["# Harness mutant kills", "", f"`python bench/verdicts/mutant_kills.py --harness {' '.join(argv)}`".replace(" `", "`"), "",
             "Each harness mutant (`tests/mutants/harness`) applied alone, in the pytest process and in every rank, "
             "then its killing tests run (`tests/mutants/harness_run.py`); `owner` names the branch whose own tests "
             "are expected to kill it too.", "",
             "| mutant | target | killing test | owner | verdict | s |", "|---|---|---|---|---|---|"]
    for name, (status, secs, _) in results.items():
        m = HARNESS[name]
        lines.append(f"| {name} | `{m.target}` | {'<br>'.join(f'`{k}`' for k in m.kills)} | {m.owner} | {status} | {secs:.0f} |")
    lines += ["", f"Kill rate: {killed}/{len(results)} = {killed / max(len(results), 1):.0%}."
              + (f" Not run yet: {', '.join(missing)}." if missing else ""), ""]
    Path(path).write_text("\n".join(lines))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mutants", nargs="+", default=list(HARNESS), choices=list(HARNESS), metavar="NAME")
    ap.add_argument("--results", default=None, metavar="PATH.md", help="write the results table here")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant's run")
    ap.add_argument("--fast", action="store_true", help="run every mutant in this process (see above)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    results: dict[str, tuple[str, float, str]] = {}
    record = Path(args.results).with_suffix(".json") if args.results else None
    if record and record.exists():  # the verdicts of earlier runs; this run replaces those it reruns
        results = {n: tuple(v) for n, v in json.loads(record.read_text()).items() if n in HARNESS}
    ran: list[str] = []
    for name in args.mutants:
        status, secs, tail = run_here(name) if args.fast else run_one(name, args.timeout)
        results[name] = (status, secs, tail)
        ran.append(name)
        print(f"{name:<42} {status:<9} {secs:6.1f} s  {' '.join(HARNESS[name].kills)}", flush=True)
        if status == "broken":
            print("   ", tail, flush=True)
        if args.results:
            record.write_text(json.dumps(results, indent=1))
            write_results(args.results, {n: results[n] for n in HARNESS if n in results},
                          ["--fast"] if args.fast else [])
    this = {n: results[n] for n in ran}
    killed = sum(s == "killed" for s, _, _ in this.values())
    print(f"kill rate: {killed}/{len(this)} = {killed / max(len(this), 1):.0%}; not killed: "
          f"{', '.join(n for n, (s, _, _) in this.items() if s != 'killed') or 'none'}")
    return 0 if killed == len(this) else 1


if __name__ == "__main__":
    sys.exit(main())
