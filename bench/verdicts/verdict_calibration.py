"""How close correct programs come to the whole-model bounds: the worst ratio err / tol (1.0 = at the
bound) over every check of a case (loss, gradients, parameter updates, checkpoint reloads, resume),
per architecture, width and policy, over seeds. A ratio near 1 is a false alarm waiting to happen;
the perturbation tests in ``tests/harness/test_model_verdict.py`` show that 1e-4 relative errors land far
above 1. One rank gang serves every case.

    python bench/verdicts/verdict_calibration.py [--models nanogpt llama ...] [--widths 32 64 128 256]
        [--seeds 0 1 2 3 4 5 6 7 8 9] [--policies dp tp] [--world-size 2] [--steps 3] [--markdown FILE]
"""
from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's packages, not an installed copy

from verify.judge.verdict import judge  # noqa: E402
from verify.runner.gang import Gang  # noqa: E402
from verify.cases.model import expected_checks  # noqa: E402

ARCHITECTURES = ["nanogpt", "llama", "gemma", "qwen3", "phi3", "t5", "vit", "resnet_gn", "mixtral_batched",
                 "transformer_encoder"]


def kind(name: str) -> str:
    """The kind of a check: loss, grad, param, initial, or checkpoint (reloads and the resume)."""
    first = name.split()[0]
    return first if first in ("loss", "grad", "param", "initial") and not name.startswith("loss of") else "checkpoint"


def ratio(c: dict) -> float:
    return c["err"] / c["tol"] if c["tol"] > 0 else (0.0 if c["err"] == 0 else float("inf"))


class Calibration:
    """Worst ratios per (model, width, policy) and per kind of check, and the cases that failed."""

    def __init__(self):
        self.cell: dict[tuple[str, int, str], tuple[float, str]] = defaultdict(lambda: (0.0, ""))
        self.kinds: dict[str, tuple[float, str]] = defaultdict(lambda: (0.0, ""))
        self.seeds: dict[tuple[str, int, str], int] = defaultdict(int)
        self.failed: list[str] = []
        self.cases = 0

    def add(self, model: str, width: int, policy: str, w: int, seed: int, status: str, detail: str,
            checks: list[dict]) -> None:
        self.cases += 1
        key, where = (model, width, policy), f"{model}@{width} {policy} W={w} seed {seed}"
        self.seeds[key] += 1
        if status != "match":
            self.failed.append(f"{where}: {status} {detail}")
        for c in checks:
            r = ratio(c)
            if r > self.cell[key][0]:
                self.cell[key] = (r, f"seed {seed}: {c['name']}")
            if r > self.kinds[kind(c["name"])][0]:
                self.kinds[kind(c["name"])] = (r, f"{where}: {c['name']}")

    def table(self, models, widths, policies) -> str:
        """Markdown: one row per (model, policy), one column per width, the worst ratio over seeds."""
        head = "| model | policy | " + " | ".join(f"w={w}" for w in widths) + " | worst check |"
        lines = [head, "|" + "---|" * (len(widths) + 3)]
        for m in models:
            for p in policies:
                cells, worst = [], (0.0, "")
                for w in widths:
                    r, where = self.cell.get((m, w, p), (None, ""))
                    n = self.seeds.get((m, w, p), 0)
                    cells.append("—" if not n else f"{r:.3f} ({n})")
                    if n and r >= worst[0]:
                        worst = (r, f"w={w} {where}")
                lines.append(f"| {m} | {p} | " + " | ".join(cells) + f" | {worst[1]} |")
        return "\n".join(lines)

    def by_kind(self) -> str:
        return "\n".join(f"| {k} | {r:.3f} | {where} |" for k, (r, where) in sorted(self.kinds.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=ARCHITECTURES)
    ap.add_argument("--widths", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    ap.add_argument("--policies", nargs="+", default=["dp", "tp"])
    ap.add_argument("--world-size", type=int, nargs="+", default=[2])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-checkpoint", action="store_true",
                    help="the training checks alone (no checkpoint reloads and resume: about 2x faster)")
    ap.add_argument("--markdown", help="also write the tables to this file (rewritten as cases finish)")
    args = ap.parse_args()
    cal, t0 = Calibration(), time.perf_counter()
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with Gang(max(args.world_size), (), args.world_size) as gang, tempfile.TemporaryDirectory() as tmp:
        for width in args.widths:  # every architecture at a width before the next width
            for model in args.models:
                name = f"{model}@{width}"
                for seed in args.seeds:
                    for w in args.world_size:
                        for policy in args.policies:
                            job = {"kind": "model", "model": name, "policy": policy, "world_size": w,
                                   "steps": args.steps, "seed": seed, "gen_dir": tmp, "dtype": args.dtype,
                                   "checkpoint": not args.no_checkpoint}
                            status, detail, checks, _ = judge(gang.run(job, w, 600),
                                                              expected_checks(name, policy, args.steps, seed,
                                                                              not args.no_checkpoint))
                            cal.add(model, width, policy, w, seed, status, detail, checks)
                            if status != "match":
                                print("  FAILED", cal.failed[-1], flush=True)
                worst = max((cal.cell[(model, width, p)][0] for p in args.policies), default=0.0)
                print(f"{name}: worst {worst:.3f}; {cal.cases} cases so far, {len(cal.failed)} failed, "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
                if args.markdown:  # rewritten as cases finish: a run stopped early keeps what it measured
                    Path(args.markdown).write_text(report(cal, args, command, started, time.perf_counter() - t0))
    text = report(cal, args, command, started, time.perf_counter() - t0, done=True)
    print("\n" + text)
    if args.markdown:
        Path(args.markdown).write_text(text)


def report(cal: Calibration, args, command: str, started: str, elapsed: float, done: bool = False) -> str:
    what = "training checks only" if args.no_checkpoint else "with checkpoint reloads and resume"
    return (f"Started {started}{'' if done else ' (still running)'}:\n\n```\n{command}\n```\n\n"
            f"{cal.cases} cases (W={' '.join(map(str, args.world_size))}, {args.steps} steps, {args.dtype}, "
            f"{what}), {len(cal.failed)} not matching, {elapsed:.0f} s\n\n"
            "Worst err/tol over every check of every seed (the number of seeds run in parentheses):\n\n"
            + cal.table(args.models, args.widths, args.policies)
            + "\n\nWorst err/tol per kind of check:\n\n| kind | worst | where |\n|---|---|---|\n" + cal.by_kind()
            + ("\n\nNot matching:\n" + "\n".join(f"- {f}" for f in cal.failed) if cal.failed else "") + "\n")


if __name__ == "__main__":
    main()
