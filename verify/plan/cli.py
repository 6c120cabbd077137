"""``python -m verify plan PATH``: a saved cluster plan, judged equal to one device on this machine.

The plan (``plan_cluster(...).save(PATH)``) is reduced (:mod:`verify.plan.reduced`: the same axes in the
same order, schedule, virtual stages, recipes, precision, and the same architecture, at degrees of 2
and a small width), lowered to what the compiler runs (:func:`nnscaler.policies.cluster_plan.lower`,
the one lowering the cost model assumed), checked to give every block's linears Megatron's
column/row split as the cost model costed them, then trained for a few AdamW steps on real ranks and
compared with one device like any whole-model case (loss, every gradient and update, checkpoint).
Exit 0 match, 1 mismatch or failure, 2 bad input (one line, before any rank starts).
"""
from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import warnings
from pathlib import Path

from nnscaler.config import PlanError
from nnscaler.policies.cluster_plan import check_lowering, load

from verify.cases.config import BadInput, RunConfig
from verify.plan.reduced import build_case, write_reduced

LAYOUT_FIELDS = ("tp_size", "pp_size", "schedule", "virtual_stages", "sequence_parallel")


def add_plan_parser(sub) -> None:
    """The ``plan`` subcommand of ``python -m verify`` (``sub``: its subparsers)."""
    p = sub.add_parser("plan", help="verify a saved cluster plan on a reduced model of the same architecture",
                       description=__doc__.splitlines()[0])
    p.add_argument("path", metavar="PATH", help="a plan file written by plan_cluster(...).save(PATH)")
    p.add_argument("--as-planned", action="store_true",
                   help="keep the plan's own parallel degrees (its world size must run here) instead of 2 per axis")
    p.add_argument("--precision", default=None, metavar="RECIPE",
                   help="run under this precision recipe instead of the plan's (e.g. 32-true)")
    p.add_argument("--steps", type=_positive_int, default=3, help="AdamW steps (default 3)")
    p.add_argument("--seed", type=_positive_int, default=0, help="seed of the model and batches (default 0)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                   help="the case's time limit is 8x this (default 60)")
    p.add_argument("--module", action="append", default=[], metavar="FILE.py",
                   help="import this file first, here and on every rank (repeatable)")
    p.add_argument("--keep", default=None, metavar="DIR",
                   help="write the reduced plan and the generated programs here (default: a temporary directory)")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return v


def _label(par) -> str:
    return (f"tp{par.tp}{'+sp' if par.sequence_parallel else ''} pp{par.pp}"
            f"{f' v{par.virtual_stages}' if par.virtual_stages > 1 else ''} dp{par.dp} mbs{par.micro_batch_size}"
            f"x{par.num_microbatches} zero{par.zero} recompute={par.recompute}")


def cmd_plan(args) -> int:
    from verify.runner.gang import Gang, max_ranks
    from verify.sweep import run_model
    from verify.report.writer import summary, table
    from verify.worker import load_modules
    for m in args.module:
        if not Path(m).is_file():
            raise BadInput(f"--module {m}: no such file")
    modules = tuple(str(Path(m).resolve()) for m in args.module)
    try:
        load_modules(modules)
    except Exception as exc:  # noqa: BLE001  (a file that cannot be imported is bad input)
        raise BadInput(f"importing {', '.join(modules)} failed: {type(exc).__name__}: {exc}") from None
    try:
        saved = load(args.path)
    except PlanError as exc:
        raise BadInput(str(exc)) from None
    if args.keep is not None and Path(args.keep).exists() and not Path(args.keep).is_dir():
        raise BadInput(f"--keep {args.keep}: not a directory")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.keep or tmp)
        out.mkdir(parents=True, exist_ok=True)
        try:
            ref = str(write_reduced(saved, out, args.as_planned))
            red = load(ref)
            precision = args.precision or red.precision
            policy, config = red.lower(precision=precision)
            case = build_case(ref, args.seed)
        except PlanError as exc:
            raise BadInput(str(exc)) from None
        if red.world > max_ranks():
            raise BadInput(f"the plan needs {red.world} ranks, more than this machine runs ({max_ranks()}); "
                           f"leave out --as-planned to verify it at 2 per axis")
        with warnings.catch_warnings():  # the plan's own warnings are the report's, not the check's
            warnings.simplefilter("ignore")
            problems = check_lowering(case.model, case.batch(0), red.parallel, precision)
        print(f"plan {saved.path}: {_label(saved.parallel)} on {saved.world} ranks, {precision}", flush=True)
        print(f"verifying it as {_label(red.parallel)} on {red.world} ranks: {policy} in each of {red.parallel.pp} "
              f"stage(s), schedule {red.parallel.schedule}; model {red.architecture['transformers']} with "
              f"{red.architecture['config']['num_hidden_layers']} layers, hidden "
              f"{red.architecture['config']['hidden_size']}", flush=True)
        if problems:
            for p in problems:
                print(f"verify plan: the compiler's plan differs from the costed one: {p}", file=sys.stderr)
            return 1
        layout = tuple((k, getattr(config, k)) for k in LAYOUT_FIELDS)
        cfg = RunConfig(world_sizes=(red.world,), seeds=(args.seed,), timeout_s=args.timeout,
                        microbatches=config.num_microbatches, zero=config.zero, recompute=config.recompute,
                        precision=precision, layout=layout)
        rerun = " ".join(shlex.quote(x) for x in ["python", "-m", "verify", "plan", str(args.path)]
                         + (["--as-planned"] if args.as_planned else [])
                         + (["--precision", args.precision] if args.precision else [])
                         + [x for m in modules for x in ("--module", m)])
        with Gang(red.world, modules, (red.world,), pg_timeout_s=max(120.0, 2 * cfg.limit_s("model", args.steps))) as gang:
            rows = list(run_model(gang, ref, (policy,), cfg, str(out), args.steps))
        for r in rows:
            r.op, r.partition = f"plan:{saved.path.name}", f"{_label(red.parallel)} {precision}"
            r.rerun = "" if r.ok else rerun
    print(table(rows))
    print(", ".join(f"{v} {k}" for k, v in summary(rows).items()))
    return 0 if rows and all(r.ok for r in rows) else 1
