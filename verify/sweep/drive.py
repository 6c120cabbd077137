"""Running the units of a sweep (:mod:`verify.sweep.selection`) on a gang: each unit from the verdict cache
when it holds it (:mod:`verify.sweep.cache`), else on the ranks; rows go to the report writer as they come."""
from __future__ import annotations

import tempfile
from dataclasses import replace
from typing import Callable, Iterable, Iterator

from verify.sweep.cache import Used, VerdictCache
from verify.config import RunConfig
from verify.judge.row import Row
from verify.rows.replicas import run_replicas
from verify.rows.torchpar_builtin import CASES as TORCH_CASES, run_builtin
from verify.plan.arguments import DEFAULT_TIMEOUT_S  # a plan unit is never held to less
from verify.runner.gang import Gang
from verify.config import RECIPE
from verify.kinds import kind_class
from verify.kinds.plan import Plan
from verify.sweep.selection import ROOT, Unit
from verify.rows.run import run_model, run_op


def run_unit(gang: Gang, unit: Unit, cfg: RunConfig, specs: dict, gen_dir: str, skip, used: Used,
             planned: dict | None = None) -> Iterator[Row]:
    """The rows of ``unit`` (leaving out the cases whose keys are in ``skip``, already done): a built-in
    kind's as :data:`UNIT_ROWS` drives them, any other kind's as it drives its own (``rows``,
    ``verify/kinds/registry.py``); ``planned``: the preflight's partitions of operators
    (``verify.rows.run.preflight``)."""
    if unit.kind in UNIT_ROWS:
        yield from UNIT_ROWS[unit.kind](gang, unit, cfg, specs, gen_dir, skip, used, planned)
    else:
        yield from kind_class(unit.kind).rows(gang, unit, cfg, gen_dir, skip, used)


def op_unit_rows(gang, unit: Unit, cfg: RunConfig, specs: dict, gen_dir: str, skip, used: Used,
                 planned: dict | None) -> Iterator[Row]:
    """A registered operator under every partition, world size and seed."""
    yield from run_op(gang, specs[unit.name], cfg, skip=skip, planned=planned)


def torchpar_unit_rows(gang, unit: Unit, cfg: RunConfig, specs: dict, gen_dir: str, skip, used: Used,
                       planned: dict | None) -> Iterator[Row]:
    """One of torch's own parallelizations (DTensor, FSDP2): no operator or rule of the catalogue runs,
    no leaf to key on."""
    case = next(c for c in TORCH_CASES if c.name == unit.name and (c.world_size,) == unit.world_sizes)
    yield from run_builtin(gang, case, replace(cfg, seeds=unit.seeds), gen_dir, skip=skip)


def model_unit_rows(gang, unit: Unit, cfg: RunConfig, specs: dict, gen_dir: str, skip, used: Used,
                    planned: dict | None) -> Iterator[Row]:
    """A whole-model case (its micro-batches, recipe and resume), or its replicas."""
    run_cfg = replace(cfg, world_sizes=unit.world_sizes, seeds=unit.seeds,
                      recipe=replace(RECIPE if unit.recipe else cfg.recipe, num_microbatches=unit.microbatches))
    if unit.replicas > 1:
        yield from run_replicas(gang, unit.name, (unit.policy,), run_cfg, gen_dir, unit.replicas, skip=skip, used=used)
    else:
        yield from run_model(gang, unit.name, (unit.policy,), run_cfg, gen_dir, steps=unit.steps, skip=skip,
                             checkpoint=unit.checkpoint, used=used)


def run_plan_unit(gang, unit: Unit, cfg: RunConfig, specs: dict, gen_dir: str, skip, used: Used,
                  planned: dict | None = None) -> Iterator[Row]:
    """A saved cluster plan as ``python -m verify plan FILE`` runs it (reduced, its own recipe), on the
    sweep's gang, or on a gang of its own when its world size is none of the sweep's (the 8 ranks of a
    tp x pp x dp plan, :func:`verify.sweep.selection.wide_plan_units`); a plan file that cannot be read or
    reduced is a failed row, not the end of the sweep."""
    from verify.config import BadInput  # noqa: PLC0415
    from verify.judge.verdict import ERROR  # noqa: PLC0415
    from verify.plan.cli import plan_rows, prepare  # noqa: PLC0415 (transformers: only a sweep with plans)
    path = ROOT / unit.name
    rerun = Plan.rerun_command(replace(cfg, modules=()), unit.name)
    with tempfile.TemporaryDirectory(dir=gen_dir) as out:
        try:
            case = prepare(path, out, seed=unit.seeds[0])
        except BadInput as exc:
            yield Row(f"plan:{path.name}", "model", "saved cluster plan", unit.world_sizes[0], "", "float32",
                      unit.seeds[0], ERROR, detail=str(exc), rerun=rerun)
            return
        timeout_s = max(cfg.timeout_s, DEFAULT_TIMEOUT_S)
        w = case.reduced.world
        if w in cfg.world_sizes:
            rows = plan_rows(gang, case, out, seed=unit.seeds[0], timeout_s=timeout_s, rerun=rerun, used=used)
        else:  # as `verify plan` starts its own: gloo's timeout far above the case's limit
            limit = replace(cfg, timeout_s=timeout_s, microbatches=case.config.num_microbatches).limit_s("model", 3)
            with Gang(w, cfg.modules, (w,), pg_timeout_s=max(120.0, 2 * limit)) as own:
                rows = plan_rows(own, case, out, seed=unit.seeds[0], timeout_s=timeout_s, rerun=rerun, used=used)
    yield from (r for r in rows if r.key not in skip)


UNIT_ROWS: dict[str, Callable[..., Iterator[Row]]] = {
    "op": op_unit_rows, "model": model_unit_rows, "torchpar": torchpar_unit_rows, "plan": run_plan_unit}
"""How each built-in unit kind runs (over ``verify/rows/``; the names its case kind is registered under,
``verify/kinds/``). Another registered kind drives its own rows."""


class LazyGang:
    """A :class:`Gang` started on its first job (a sweep whose verdicts all come from the cache, or a
    ``--resume`` with nothing left, starts no ranks); ``before`` runs once, after the start, before
    that first job (the preflight)."""

    def __init__(self, make: Callable[[], Gang], before: Callable[[Gang], None] = lambda g: None):
        self._make, self._before, self.gang = make, before, None
        self.planned: dict = {}  # what ``before`` found out, for the units (the preflight's partitions)

    def run(self, job: dict, ranks: int, timeout_s: float):
        if self.gang is None:
            self.gang = self._make()
            self.gang.__enter__()
            self._before(self.gang)
        return self.gang.run(job, ranks, timeout_s)

    @property
    def starts(self) -> int:
        return self.gang.starts if self.gang is not None else 0

    def __enter__(self) -> "LazyGang":
        return self

    def __exit__(self, *exc) -> None:
        if self.gang is not None:
            self.gang.__exit__(*exc)


def run_units(gang, units, cfg: RunConfig, specs: dict, gen_dir: str, skip, hits: dict,
              cache: VerdictCache | None, record: Callable[[Unit, Iterable[Row], bool], list[Row]]) -> None:
    """Each unit in turn, its rows from the cache (``hits``: unit -> cached rows) or from the ranks,
    handed to ``record(unit, rows, cached)``, which writes each row as it comes and returns them
    all; a run unit's rows are then cached."""
    for unit in units:
        rows = hits.get(unit)
        if rows is not None:
            record(unit, [r for r in rows if r.key not in skip], True)
            continue
        used = Used()
        rows = record(unit, run_unit(gang, unit, cfg, specs, gen_dir, skip, used, getattr(gang, "planned", None)),
                      False)
        if cache is not None:
            cache.put(unit, rows, used)
