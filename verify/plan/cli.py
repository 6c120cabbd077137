"""``python -m verify plan PATH``: a saved cluster plan, judged equal to one device on this machine.

The plan (``plan_cluster(...).save(PATH)``) is reduced (:mod:`verify.models.saved_plan`: the same axes in the
same order, schedule, virtual stages, recipes, precision, and the same architecture, at degrees of 2
and a small width), lowered to what the compiler runs (:func:`nnscaler.cluster.plan.lower`,
the one lowering the cost model assumed), checked to give every block's linears Megatron's
column/row split as the cost model costed them, then trained for a few AdamW steps on real ranks and
compared with one device like any whole-model case (loss, every gradient and update, checkpoint).
:func:`prepare` and :func:`plan_rows` are the same on any gang (``verify all`` can run saved plans so).
Exit 0 match, 1 mismatch or failure, 2 bad input (one line, before any rank starts), a plan with a context
parallelism scheme the compiler does not lower included (refused naming what is missing, never reduced without
its cp axis or scheme); a cp plan it lowers is reduced keeping its cp degree (2), scheme and balance and runs as
``cp_tp``, ``cp_tp_balanced``, ``cp_tp_ring(_balanced)``, ``ulysses`` or ``cp_tp_ulysses`` (its label says
``-balanced`` for Llama 3's chunk order).
"""
from __future__ import annotations

import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from nnscaler.config import ComputeConfig, PlanError
from nnscaler.cluster.plan import SavedPlan, check_lowering, cp_refusal, load

from verify.config import BadInput, RunConfig

from verify.judge.row import Row
from verify.kinds.plan import Plan
from verify.judge.verdict import MISMATCH
from verify.models.saved_plan import build_case, write_reduced

LAYOUT_FIELDS = ("tp_size", "pp_size", "schedule", "virtual_stages", "sequence_parallel")


def _label(par) -> str:
    balanced = "-balanced" if par.cp_balanced and par.cp_scheme != "ulysses" else ""
    return (f"tp{par.tp}{'+sp' if par.sequence_parallel else ''}{f' cp{par.cp}-{par.cp_scheme}{balanced}' if par.cp > 1 else ''} "
            f"pp{par.pp}"
            f"{f' v{par.virtual_stages}' if par.virtual_stages > 1 else ''} dp{par.dp} mbs{par.micro_batch_size}"
            f"x{par.num_microbatches} zero{par.zero} recompute={par.recompute}")


def refuse_unlowered(saved: SavedPlan) -> None:
    """A plan with a context-parallel scheme the compiler does not lower (:func:`~nnscaler.cluster.plan.cp_refusal`)
    is bad input naming its file and what is missing, before any reduction: checking it without that scheme
    would verify another plan."""
    refusal = cp_refusal(saved.parallel)
    if refusal:
        raise PlanError(f"{saved.path}: " + refusal)


@dataclass(frozen=True)
class PlanCase:
    """A saved plan made ready for the ranks (:func:`prepare`): the plan, its reduced plan file (``ref``, a
    model reference), what the compiler runs for it, and where the compiler's per-operator plan of the
    reduced model differs from the costed one (``problems``, one line each)."""

    saved: SavedPlan
    reduced: SavedPlan
    ref: str
    policy: str
    config: ComputeConfig
    problems: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"{_label(self.reduced.parallel)} {self.config.precision}"


def prepare(path: str | os.PathLike, out_dir: str | os.PathLike, as_planned: bool = False,
            precision: str | None = None, seed: int = 0, ranks: int | None = None) -> PlanCase:
    """Read, reduce (into ``out_dir``), lower and check the plan at ``path`` before any rank starts;
    bad input is one :class:`BadInput` line. ``ranks``: the size of the torchrun job it must run on
    (``verify.cluster plan``), else it must fit this machine's gang."""
    from verify.runner.gang import max_ranks
    try:
        saved = load(path)
        refuse_unlowered(saved)
        ref = str(write_reduced(saved, out_dir, as_planned))
        red = load(ref)
        policy, config = red.lower(precision=precision)
        case = build_case(ref, seed)
    except PlanError as exc:
        raise BadInput(str(exc)) from None
    if ranks is not None and red.world != ranks:
        raise BadInput(f"the plan runs on {red.world} ranks{' as planned' if as_planned else ' reduced to 2 per axis'}, "
                       f"the torchrun job has {ranks}: start torchrun with {red.world} ranks in all")
    if ranks is None and red.world > max_ranks():
        smaller = "leave out --as-planned to verify it at 2 per axis, or " if as_planned else ""
        raise BadInput(f"the plan needs {red.world} ranks, more than this machine runs ({max_ranks()}); "
                       f"{smaller}verify it at its size on a cluster (torchrun ... -m verify.cluster plan PATH "
                       f"--as-planned)")
    with warnings.catch_warnings():  # the plan's own warnings are the report's, not the check's
        warnings.simplefilter("ignore")
        problems = check_lowering(case.model, case.batch(0), red.parallel, config.precision)
    return PlanCase(saved, red, ref, policy, config, tuple(problems))


def plan_rows(gang, case: PlanCase, out_dir: str | os.PathLike, steps: int = 3, seed: int = 0,
              timeout_s: float = 60.0, rerun: str = "", used=None) -> list[Row]:
    """The rows of one prepared plan on ``gang`` (``case.reduced.world`` of its ranks): a failed row
    naming the first operator split otherwise than costed, or the whole-model case against one device
    (``used``: a :class:`verify.sweep.cache.Used` collecting what the ranks ran, for ``verify all``'s cache)."""
    from verify.rows.run import run_model
    name = f"plan:{case.saved.path.name}"
    if case.problems:
        return [Row(name, "model", "the compiler's per-operator plan vs the costed one", case.reduced.world,
                    case.label, "float32", seed, MISMATCH,
                    detail=f"{len(case.problems)} operator(s) split otherwise than costed; first: {case.problems[0]}",
                    rerun=rerun)]
    c = case.config
    cfg = RunConfig(world_sizes=(case.reduced.world,), seeds=(seed,), timeout_s=timeout_s,
                    microbatches=c.num_microbatches, zero=c.zero, recompute=c.recompute, precision=c.precision,
                    layout=tuple((k, getattr(c, k)) for k in LAYOUT_FIELDS + (("cp_size",) if c.cp_size else ())))
    rows = list(run_model(gang, case.ref, (case.policy,), cfg, str(out_dir), steps, used=used))
    for r in rows:
        r.op, r.partition, r.rerun = name, case.label, "" if r.ok else rerun
    return rows


def cmd_plan(args) -> int:
    from verify.runner.gang import Gang
    from verify.report.progress import RunProgress
    from verify.report.writer import summary, table
    from verify.runner.worker import load_modules
    for m in args.module:
        if not Path(m).is_file():
            raise BadInput(f"--module {m}: no such file")
    modules = tuple(str(Path(m).resolve()) for m in args.module)
    try:
        load_modules(modules)
    except Exception as exc:  # noqa: BLE001  (a file that cannot be imported is bad input)
        raise BadInput(f"importing {', '.join(modules)} failed: {type(exc).__name__}: {exc}") from None
    if args.keep is not None and Path(args.keep).exists() and not Path(args.keep).is_dir():
        raise BadInput(f"--keep {args.keep}: not a directory")
    rerun = Plan.rerun_command(RunConfig(modules=modules), args.path, args.as_planned, args.precision)
    ranks = getattr(args, "ranks", None)  # verify.cluster: the torchrun job's ranks in the gang's place
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.keep or tmp)
        out.mkdir(parents=True, exist_ok=True)
        print(f"reading {args.path}: {'' if args.as_planned else 'reducing it to 2 ranks per axis, '}building its "
              f"model and checking its lowering", flush=True)
        case = prepare(args.path, out, args.as_planned, args.precision, args.seed,
                       None if ranks is None else ranks.size)
        red = case.reduced.parallel
        print(f"plan {case.saved.path}: {_label(case.saved.parallel)} on {case.saved.world} ranks, "
              f"{case.saved.precision}", flush=True)
        print(f"verifying it as {case.label} on {case.reduced.world} ranks: {case.policy} in each of {red.pp} "
              f"stage(s), schedule {red.schedule}; model {case.reduced.architecture['transformers']} with "
              f"{case.reduced.architecture['config']['num_hidden_layers']} layers, hidden "
              f"{case.reduced.architecture['config']['hidden_size']}", flush=True)
        limit = RunConfig(timeout_s=args.timeout, microbatches=case.config.num_microbatches).limit_s("model", args.steps)
        gang = ranks if ranks is not None else \
            Gang(case.reduced.world, modules, (case.reduced.world,), pg_timeout_s=max(120.0, 2 * limit))
        label = f"plan:{case.saved.path.name} {case.label}"
        with gang, RunProgress(1) as progress:  # as the other commands show theirs (verify/report/progress.py)
            progress.start(label)
            rows = plan_rows(gang, case, out, args.steps, args.seed, args.timeout, rerun)
            progress.done(label, rows)
    print(table(rows))
    print(", ".join(f"{v} {k}" for k, v in summary(rows).items()))
    return 0 if rows and all(r.ok for r in rows) else 1
