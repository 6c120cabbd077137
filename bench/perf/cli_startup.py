"""Start-up of ``python -m verify``: the light entry (``verify/__main__.py``: parser without torch,
``list`` from its source-keyed cache) against the old one (``verify.cli``, which imports torch, the
compiler and the harness before parsing). Each command pair runs alternately, ``--rounds`` times, in
the same run, so the ratio stands on a noisy machine; medians of wall seconds are printed.

    python bench/perf/cli_startup.py [--rounds 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OLD = "import sys; from verify.cli import main; sys.exit(main(sys.argv[1:]))"  # everything imported, then parsed


def wall(argv: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, PYTHONPATH=str(ROOT), XDG_CACHE_HOME=cache)
        new_cmd, old_cmd = [sys.executable, "-m", "verify"], [sys.executable, "-c", OLD]
        wall(new_cmd + ["list"], env)  # fills the catalogue cache once (a first ``list`` imports the catalogue)
        print(f"{'command':<24} {'new s':>7} {'old s':>7} {'old/new':>8}")
        for cmd in (["--help"], ["--version"], ["model", "--help"], ["list"]):
            new, old = [], []
            for _ in range(args.rounds):
                new.append(wall(new_cmd + cmd, env))
                old.append(wall(old_cmd + cmd, env))
            n, o = statistics.median(new), statistics.median(old)
            print(f"{' '.join(cmd):<24} {n:7.2f} {o:7.2f} {o / n:7.1f}x", flush=True)
        cold = []
        for _ in range(max(1, args.rounds // 2)):  # list with an empty cache: what a first run pays
            Path(cache, "nnscaler-verify", "catalogue.json").unlink(missing_ok=True)
            cold.append(wall(new_cmd + ["list"], env))
        print(f"{'list (cache empty)':<24} {statistics.median(cold):7.2f}")


if __name__ == "__main__":
    main()
