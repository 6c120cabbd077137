"""``python -m verify all``: the default sample of units or ``--full``'s whole matrix
(:mod:`verify.sweep.selection`), a ``--shard``'s share of it (:mod:`verify.sweep.shard`), verdicts from the cache
(:mod:`verify.sweep.cache`), the rest run on one lazily started gang (:mod:`verify.sweep.drive`), every row written
to the reports as it comes, with progress and an ETA from recorded unit times."""
from __future__ import annotations

import importlib.util
import tempfile
import time

from verify.sweep.cache import VerdictCache
from verify.rows.torchpar_builtin import CASES as TORCH_CASES
from verify.cases.zero import zero_applies
from verify.options import gang_for, load_registry, run_config
from verify.arguments import UsageError
from verify.sweep.drive import LazyGang, run_units
from verify.models.loader import known_model
from verify.models.registry import MODELS
from verify.report.progress import RunProgress
from verify.report.writer import ReportWriter, summary, table
from verify.sweep.selection import ZOO, default_units, full_order, full_units, saved_plans
from verify.sweep.shard import ShardError, estimate, fingerprint, parse_shard, recorded_times, shard
from verify.catalogue import source_key
from verify.rows.run import check_spec, preflight
from verify.runner.worker import load_modules
from nnscaler.policies import POLICIES
from nnscaler.recipe import Recipe


def _selection(args, cfg, specs, models, torch_cases) -> tuple[list, list]:
    """(the units this run runs, the whole selection they are cut from): the default sample or
    ``--full``'s matrix (:mod:`verify.sweep.selection`), then ``--shard``'s share."""
    recipes = cfg.recipe == Recipe()  # the recipe units run only where the run sets no recipe of its own
    policies = list(POLICIES)  # the cp ones on verify.sweep.selection.SEQUENCE_MODELS only
    full = full_units([s.name for s in specs], models, policies, cfg.world_sizes, cfg.seeds,
                      list(dict.fromkeys(args.random_seeds)), args.microbatches,
                      [c for c in torch_cases if c.world_size in cfg.world_sizes], recipes, _zoo(args),
                      saved_plans() if recipes and not args.op and args.model is None else (),
                      kinds=not args.op and args.model is None)  # --op, --model: what runs is named
    if cfg.precision != "32-true":  # replica cases run 32-true only: left out rather than mislabelled
        full = [u for u in full if u.replicas == 1]
    if cfg.zero:
        full = [u for u in full if u.kind != "model" or zero_applies(u.policy, u.world_sizes[0] // u.replicas,
                                                                      u.replicas, zero=cfg.zero)]
    default = default_units(full, models, policies, cfg.world_sizes, list(dict.fromkeys(args.random_seeds)))
    units = full_order(full, default) if args.full else default
    if args.shard:
        i, n = parse_shard(args.shard)
        return shard(units, i, n), units
    return units, units


def _zoo(args) -> tuple[str, ...]:
    """The zoo architectures ``verify all`` runs: :data:`verify.sweep.selection.ZOO` unless ``--op`` or
    ``--model`` chose what runs, or ``transformers`` is not installed."""
    if args.op or args.model is not None or importlib.util.find_spec("transformers") is None:
        return ()
    return ZOO


def _finished_units(before: dict) -> dict:
    """The ``units``, ``rerun`` and ``seconds`` of a resumed run's sweep: the units it finished, less
    those with a row that failed to run (error, timeout, crash: they run again)."""
    again = set(before.get("rerun", []))
    units = [u for u in before.get("units", []) if u not in again]
    return {"units": units, "rerun": [], "seconds": {u: s for u, s in before.get("seconds", {}).items() if u in units}}


def cmd_all(args) -> int:
    catalogue = {s.name for s in load_modules(())}  # the built-in operators: sampled in their own units
    reg = load_registry(args.module)
    cfg = run_config(args)
    specs = [reg.get(n) for n in args.op] if args.op else list(reg)
    unknown = [m for m in args.model or () if not known_model(m)]
    if unknown:
        raise UsageError(f"unknown model {unknown[0]!r}; known: {', '.join(sorted(MODELS))}")
    models = (sorted(MODELS) if not args.op else []) if args.model is None else args.model
    torch_names = args.torchpar if args.torchpar is not None else \
        ([] if args.op or args.model is not None else sorted({c.name for c in TORCH_CASES}))
    unknown = sorted(set(torch_names) - {c.name for c in TORCH_CASES})
    if unknown:
        raise UsageError(f"--torchpar {unknown[0]}: no such case; known: {', '.join(sorted({c.name for c in TORCH_CASES}))}")
    try:
        units, selection = _selection(args, cfg, specs, models, [c for c in TORCH_CASES if c.name in torch_names])
    except ShardError as exc:
        raise UsageError(str(exc)) from None
    writer = ReportWriter(args.reports, cfg, resume=args.resume)  # refuses a busy or unwritable directory
    shard_of = parse_shard(args.shard) if args.shard else (1, 1)
    writer.sweep = {"mode": "full" if args.full else "default", "selection": fingerprint(selection),
                    "source": source_key(),  # verify merge: shards of one run ran the same code
                    "shard": shard_of[0], "shards": shard_of[1], "total": len(selection),
                    **_finished_units(writer.sweep if args.resume else {})}
    done = writer.done()
    finished = set(writer.sweep["units"])  # --resume: units the interrupted run finished
    cache = None if args.no_cache else VerdictCache(args.cache_dir, cfg, reg)
    hits = {u: cache.get(u) for u in units if u.label not in finished} if cache is not None else {}
    units = [u for u in units if u.label not in finished]
    start = time.perf_counter()
    times = recorded_times()
    print(f"verifying {len(specs)} operators and {len({u.name for u in units if u.kind == 'model'})} models "
          f"({'the whole matrix' if args.full else 'the default sample; --full runs the whole matrix'}"
          f"{f', shard {args.shard}' if args.shard else ''}): {len(units)} units"
          + (f" ({sum(v is not None for v in hits.values())} from the verdict cache)" if cache is not None else "")
          + (f", {len(finished)} finished before" if finished else "")
          + f" at world sizes {list(cfg.world_sizes)}, dtype {cfg.dtype}; reports in {args.reports}/", flush=True)
    by_name = {s.name: s for s in specs}
    to_check = [by_name[u.name] for u in units if u.kind == "op" and hits.get(u) is None]
    to_sample = [s for s in to_check if s.name not in catalogue]  # the user's operators, before any case
    gang = LazyGang(lambda: gang_for(cfg, args), lambda g: preflight(g, to_sample, cfg, gang.planned))
    for spec in to_check:  # what can be checked without ranks, before anything runs
        check_spec(spec)
    try:
        with gang, tempfile.TemporaryDirectory() as tmp, \
                RunProgress(len(units), [0.0 if hits.get(u) is not None else t
                                         for u, t in zip(units, estimate(units, times))]) as progress:

            def record(unit, rows, cached):  # each row is written the moment it is known
                progress.start(unit.label)
                t0, new = time.perf_counter(), []
                for row in rows:
                    writer.add(row)
                    new.append(row)
                progress.done(unit.label, new, cached)
                writer.sweep["units"].append(unit.label)
                if any(r.status in ReportWriter.RERUN for r in new):  # --resume runs it again
                    writer.sweep["rerun"].append(unit.label)
                writer.sweep["seconds"][unit.label] = round(sum(r.seconds for r in new) if cached else
                                                            time.perf_counter() - t0, 3)
                writer.seconds = time.perf_counter() - start
                writer.flush_now_and_then()
                return new

            run_units(gang, units, cfg, by_name, tmp, done, hits, cache, record)
    finally:
        writer.seconds = time.perf_counter() - start
        writer.close()
    failed = [r for r in writer.rows if not r.ok]
    if failed:
        print(table(failed, with_op=True))
    s = summary(writer.rows)
    cached = sum(r.cached for r in writer.rows)
    print(", ".join(f"{v} {k}" for k, v in s.items()) + (f" ({cached} from the cache)" if cached else "")
          + f" in {writer.seconds:.1f} s; gang started {gang.starts if gang else 0}x")
    return 0 if not failed else 1
