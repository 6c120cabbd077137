"""Apply each mutant of ``catalog.py`` in turn and run a reduced ``python -m verify all`` against it
(every rank imports a shim ``--module`` file that applies the mutant); a mutant is killed when the
run exits 1 (some row failed). Prints one line per mutant and the kill rate.

    python -m tests.mutants.run [--mutants NAME ...] [--model nanogpt padded_gpt ...] [--op linear]
        [--world-size 2 4] [--random-seeds 0 1 2] [--json results.json]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .catalog import MUTANTS

ROOT = Path(__file__).resolve().parents[2]
MODELS = ["weightnorm_mlp", "bucketed_mlp", "padded_gpt", "nanogpt", "gpt2_v96"]  # fast ones first


def shim(directory: Path, name: str) -> Path:
    """A ``--module`` file that applies mutant ``name`` on import."""
    path = directory / f"mutant_{name}.py"
    path.write_text("import importlib.util, sys\n"
                    f"spec = importlib.util.spec_from_file_location('nnscaler_mutants', {str(Path(__file__).with_name('catalog.py'))!r})\n"
                    "mod = sys.modules.get('nnscaler_mutants')\n"
                    "if mod is None:\n"
                    "    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
                    "    sys.modules['nnscaler_mutants'] = mod\n"
                    f"    mod.apply({name!r})\n")
    return path


def run_one(name: str | None, args, tmp: Path) -> tuple[str, float, str]:
    """(``killed`` | ``survived`` | ``broken``, seconds, last lines) of one mutant (None: no mutant)."""
    cmd = [sys.executable, "-m", "verify", "all", "--reports", str(tmp / f"reports_{name}"), "--op", *args.op,
           "--model", *args.model, "--world-size", *map(str, args.world_size),
           "--random-seeds", *map(str, args.random_seeds), "--timeout", str(args.timeout)]
    if name is not None:
        cmd += ["--module", str(shim(tmp, name))]
    start = time.perf_counter()
    lines: list[str] = []
    killed = False
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if args.fail_fast and " cases " in line and _failed_count(line) > 0:
                killed = True  # the first failing row kills the mutant; stop this run (our own child):
                proc.send_signal(signal.SIGINT)  # an interrupt lets it stop its rank gang cleanly
                break
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:  # the run's own session: its forkserver and ranks too, should any outlive it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    tail = "\n".join(lines[-3:])
    status = "killed" if killed else {0: "survived", 1: "killed"}.get(proc.returncode, "broken")
    return status, time.perf_counter() - start, tail


def _failed_count(line: str) -> int:
    """The failed count of a ``verify all`` progress line (``label N cases M match K failed T s``)."""
    words = line.split()
    try:
        return int(words[words.index("failed") - 1])
    except (ValueError, IndexError):
        return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mutants", nargs="+", default=list(MUTANTS), choices=list(MUTANTS), metavar="NAME")
    ap.add_argument("--model", nargs="+", default=MODELS)
    ap.add_argument("--op", nargs="+", default=["relu", "linear"])
    ap.add_argument("--world-size", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--random-seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run (which must pass)")
    ap.add_argument("--no-fail-fast", dest="fail_fast", action="store_false",
                    help="run every case of a mutant even after its first failing row")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    results: dict[str, str] = {}
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
            results[name] = status
            print(f"{name:<40} {status:<9} {secs:6.0f} s", flush=True)
            if status == "broken":
                print("   ", tail.replace("\n", "\n    "))
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
    killed = sum(s == "killed" for s in results.values())
    print(f"kill rate: {killed}/{len(results)} = {killed / max(len(results), 1):.0%}; survived: "
          f"{', '.join(n for n, s in results.items() if s == 'survived') or 'none'}")
    return 0 if all(s != "broken" for s in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
