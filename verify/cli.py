"""``python -m verify``: ``op NAME``, ``model NAME``, ``list``, ``lint``, ``all`` and ``plan PATH``
(:mod:`verify.plan.cli`).

Exit codes: 0 every row matched, 1 some row failed (mismatch, error, timeout, crash), 2 bad input
(unknown operator, bad flag, malformed annotation), with one line on stderr.
"""
from __future__ import annotations

from dataclasses import replace
import importlib.util
import json
import math
import shlex
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Sequence


from nnscaler.dimops.grammar import AnnotationError
from nnscaler.ops.lint import AnnotationWarning
from nnscaler.ops.registry import OpRegistry, UnknownOpError

from nnscaler.config import ComputeConfig
from nnscaler.policies import POLICIES, PlanError

from verify.cases.config import BadInput, Row, RunConfig
from verify.judge.lowprec import precheck
from verify.judge.verdict import MISMATCH

from verify.sweep import check_spec, preflight, run_model, run_op
from verify.lint import lint
from verify.catalogue import current_key, render, store_rows
from verify.cases.model import PolicyFileError, resolve_policy
from verify.cases.pipeline import check_pipeline_input
from verify.cases.node import UnknownNode, model_graph, node_op
from verify.models.registry import MODELS
from verify.models.zoo import is_zoo
from verify.models.loader import build_model, known_model
from verify.models.registry import ModelCase
from verify.models.loader import ModelNotFound, check_builder, is_file_reference
from verify.runner.gang import PG_TIMEOUT_S, Gang, GangError, MemoryCapError, WorldSizeError
from verify.report.progress import RunProgress
from verify.cases.replica_rows import run_replicas
from verify.cache import VerdictCache
from verify.drive import LazyGang, run_units
from verify.selection import ZOO, default_units, full_order, full_units, saved_plans
from verify.shard import ShardError, estimate, fingerprint, parse_shard, recorded_times, shard
from verify.cases.zero import zero_applies, zero_refusal
from verify.cases.torchpar_mesh import parse_mesh
from verify.cases.torchpar_builtin import CASES as TORCH_CASES
from verify.cases.torchpar_rows import BAD_INPUT as TORCHPAR_BAD_INPUT, check_parallelize, run_torchpar
from verify.report.writer import ReportError, ReportWriter, summary, table
from verify.worker import load_modules
from verify.arguments import DEFAULT_WORLD_SIZES, UsageError, build_parser
from verify.names import POLICY_NAMES
from verify.plan.cli import cmd_plan



def _config(args) -> RunConfig:
    if args.world_size is None:
        args.world_size = list(DEFAULT_WORLD_SIZES)
    if args.base is not None and any(args.base % w for w in args.world_size):
        raise UsageError(f"--base {args.base} is not a multiple of every world size {args.world_size}")
    microbatches = getattr(args, "microbatches", 1)
    precision = getattr(args, "precision", "32-true")
    try:  # the compiler's own check: an unknown name, or bf16 on a device without it, in one line
        ComputeConfig(1, precision=precision)
    except PlanError as exc:
        raise UsageError(str(exc)) from None
    if precision != "32-true" and args.dtype != "float32":
        raise UsageError(f"--precision {precision} sets the dtypes itself; leave --dtype at float32 (got {args.dtype})")
    if getattr(args, "grad_reduce_dtype", None) and precision != "bf16-mixed":
        raise UsageError("--grad-reduce-dtype needs --precision bf16-mixed")
    zero = getattr(args, "zero", 0)
    try:
        ComputeConfig(1, zero=zero)  # the one check of the option: 0..3
    except PlanError as exc:
        raise UsageError(f"--zero {zero}: {exc}") from None
    recipe = {"clip_grad_norm": getattr(args, "clip_grad_norm", None), "recompute": getattr(args, "recompute", "none")}
    try:  # bad recipe values are one line naming the option, before any rank starts
        ComputeConfig(1, **recipe, zero=zero)
    except PlanError as exc:
        raise UsageError(str(exc)) from None
    return RunConfig(**recipe, zero=zero, precision=precision, grad_reduce_dtype=getattr(args, "grad_reduce_dtype", None),
                     world_sizes=tuple(dict.fromkeys(args.world_size)), dtype=args.dtype, seeds=tuple(args.seed),
                     modules=tuple(args.module), timeout_s=args.timeout, partition=getattr(args, "partition", None),
                     base_override=args.base, microbatches=microbatches if isinstance(microbatches, int) else 1)


def _imported(modules: Sequence[str]) -> tuple[OpRegistry, list[warnings.WarningMessage]]:
    """The registry with ``modules`` imported, and what their import warned of, not yet shown (input
    refused later is one line, with no warnings before it): :func:`_say` shows them."""
    for m in modules:
        if not Path(m).is_file():
            raise UsageError(f"--module {m}: no such file")
    try:
        with warnings.catch_warnings(record=True) as caught:
            return load_modules(modules), caught
    except AnnotationError as exc:
        raise UsageError(str(exc)) from None
    except SystemExit as exc:
        raise UsageError(f"importing {', '.join(modules)} called sys.exit({exc.code!r})") from None
    except Exception as exc:
        raise UsageError(f"importing {', '.join(modules)} failed: {type(exc).__name__}: {exc}") from None


def _say(caught: Sequence[warnings.WarningMessage], findings: Sequence = ()) -> None:
    """Each warning once, in one line at the user's line that caused it; then each lint finding not
    already said so."""
    said = set()
    for w in caught:
        if str(w.message) not in said:
            said.add(str(w.message))
            print(f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}", file=sys.stderr, flush=True)
    for finding in findings:
        if str(finding) not in said:
            print(f"verify: warning: {finding}", file=sys.stderr, flush=True)


def _load(modules: Sequence[str]) -> OpRegistry:
    reg, caught = _imported(modules)
    _say(caught)
    return reg


def _gang(cfg: RunConfig, args) -> Gang:
    """The ranks for ``cfg``: gloo's own timeout stays far above the longest case limit; under
    ``verify.cluster``, the torchrun job's ranks (``args.ranks``, set by its ``prepare``)."""
    if getattr(args, "ranks", None) is not None:
        return args.ranks
    sweep = getattr(args, "microbatches", 1)  # `all`: a list of micro-batch counts; the longest case sets the limit
    most = max([cfg.microbatches, *sweep]) if isinstance(sweep, list) else cfg.microbatches
    longest = replace(cfg, microbatches=most).limit_s("model", getattr(args, "steps", 3))
    return Gang(max(cfg.world_sizes), cfg.modules, cfg.world_sizes, memory_mb=args.rank_memory,
                pg_timeout_s=max(PG_TIMEOUT_S, 2 * longest))


def _json_target(path: str | None) -> None:
    """Fail before the run, not after it, when ``--json`` cannot be written."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"--json {path}: is a directory")
    try:
        p.write_text("[]\n")
    except OSError as exc:
        raise UsageError(f"--json {path}: cannot write: {exc.strerror or exc}") from None


def _write_json(path: str | None, rows) -> None:
    if path is None:
        return
    try:
        Path(path).write_text(json.dumps([r.to_json() for r in rows], indent=1))
    except OSError as exc:
        raise ReportError(f"--json {path}: writing failed: {exc.strerror or exc}") from None


def cmd_list(args) -> int:
    key = None if args.module else current_key()  # read before the import: the rows belong to this source
    reg = _load(args.module)
    rows = [[s.name, s.family, s.annotation, ", ".join(s.aten)] for s in reg]
    store_rows(key, rows)  # the next plain ``list`` answers without torch (verify/__main__.py)
    print(render(rows))
    return 0


def cmd_lint(args) -> int:
    reg = _load(args.module)
    specs = [reg.get(n) for n in args.names] if args.names else list(reg)
    found = lint(specs, dynamic=not args.static)
    for f in found:
        print(f"{f.kind:<13} {f}")
    print(f"{len(specs)} operators checked, {len(found)} findings")
    return 1 if found else 0


def _write_reports(writer: ReportWriter | None, rows) -> None:
    """``--reports DIR`` of ``op`` and ``model``: the files ``verify all`` writes, for these rows."""
    if writer is None:
        return
    for row in rows:
        writer.add(row)
    writer.seconds = sum(r.seconds for r in rows)
    writer.close()


def _check_model(name: str, build: bool = False) -> ModelCase | None:
    """A model reference that names a builder (exit 2 otherwise, before any rank starts); with
    ``build`` (or a file reference, which is checked by building it), the parent's one inspection
    build of it at seed 0, which every check before the ranks start reads."""
    if is_file_reference(name) or is_zoo(name):
        try:
            return check_builder(name)  # exists, returns a case, its batch fits: before any rank starts
        except ModelNotFound as exc:
            raise UsageError(str(exc)) from None
    if not known_model(name):
        raise UsageError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))} (or NAME@WIDTH, or "
                         f"FILE.py:BUILDER[@WIDTH] where BUILDER(seed[, WIDTH]) returns a ModelCase or (model, batch_fn))")
    return build_model(name, 0) if build else None


def _node_spec(args, cfg: RunConfig):
    """``op --model M --node N``: the traced operator's spec and a line saying what it is."""
    if args.name is not None:
        raise UsageError(f"give an operator NAME or --model MODEL --node NODE, not both (got {args.name!r} and --model)")
    if args.node is None:
        raise UsageError("--model needs --node NODE, the operator's name in the traced model")
    _check_model(args.model)
    try:
        op = node_op(model_graph(args.model, cfg.seeds[0], cfg.dtype), args.model, args.node)
    except UnknownNode as exc:
        raise UsageError(str(exc)) from None
    return op.spec, f"{args.model}:{args.node} ({op.overload}{', ' + op.source if op.source else ''})"


def cmd_op(args) -> int:
    reg, caught = _imported(args.module)  # said once the operator's input passed the checks (preflight)
    cfg = _config(args)
    wrong_backward: list[Row] = []
    notes = []
    if args.model is not None:
        cfg = replace(cfg, node=(args.model, args.node or ""))
        spec, what = _node_spec(args, cfg)
    elif args.name is None or args.node is not None:
        raise UsageError("give an operator NAME, or --model MODEL --node NODE")
    else:
        spec = reg.get(args.name)
        what = spec.name
        for finding in lint([spec]):  # before any rank runs: the likely mistake, with its fix
            if finding.kind == "backward":  # the ranks would compare that backward with itself: a failed row
                wrong_backward.append(Row(spec.name, spec.family, spec.annotation, 1, "own backward (gradcheck)",
                                          "float64", cfg.seeds[0], MISMATCH, detail=finding.message,
                                          rerun=f"python -m verify lint {shlex.quote(spec.name)}"
                                          + "".join(f" --module {shlex.quote(m)}" for m in cfg.modules)))
            elif finding.kind != "failed":  # a function that cannot run at all is bad input, said below in one line
                notes.append(finding)
        caught = [w for w in caught if not issubclass(w.category, AnnotationWarning)  # the others' are not ours
                  or str(w.message).startswith(f"{spec.name}: ")]
    _json_target(args.json)
    command = f"op {args.name}" if args.model is None else f"op --model {args.model} --node {args.node}"
    writer = None if args.reports is None else ReportWriter(args.reports, cfg, resume=args.resume, command=command)
    print(f"verifying {what} `{spec.annotation}` at world sizes {list(cfg.world_sizes)}, "
          f"dtype {cfg.dtype}, seeds {list(cfg.seeds)}", flush=True)
    rows = list(wrong_backward)
    with _gang(cfg, args) as gang, RunProgress(len(cfg.world_sizes)) as progress:
        preflight(gang, [spec], cfg)
        _say(caught, notes)
        for w in cfg.world_sizes:  # one progress item per world size, at the lengths of the whole run
            label = f"{cfg.row_name(spec)} W={w}"
            progress.start(label)
            new = list(run_op(gang, spec, replace(cfg, world_sizes=(w,), base_override=cfg.base)))
            progress.done(label, new)
            rows += new
    print(table(rows))
    s = summary(rows)
    print(", ".join(f"{v} {k}" for k, v in s.items()))
    _write_reports(writer, rows)
    _write_json(args.json, rows)
    return 0 if all(r.ok for r in rows) else 1


def _policies(specs: Sequence[str]) -> tuple[str, ...]:
    """Built-in names as given; ``FILE.py:fn`` checked here and made absolute (the ranks import it)."""
    out = []
    for spec in specs:
        if spec not in POLICIES and ":" in spec:
            path, _, fn = spec.rpartition(":")
            spec = f"{Path(path).resolve()}:{fn}"
        out.append(spec)
        try:
            resolve_policy(spec)
        except PolicyFileError as exc:
            raise UsageError(str(exc)) from None
        except Exception as exc:
            raise UsageError(f"policy {spec!r}: importing its file failed: {type(exc).__name__}: {exc}") from None
    return tuple(dict.fromkeys(out))


def cmd_model(args) -> int:
    _load(args.module)
    case = _check_model(args.name, build=True)  # the one build before the ranks start
    if args.parallelize is not None or args.mesh is not None:
        return cmd_torchpar(args)
    policies = _policies(args.policy or POLICY_NAMES)  # no --policy: every built-in
    cfg = _config(args)
    try:  # a pipeline the model cannot be cut into, or a batch that does not divide: before any rank starts
        check_pipeline_input(args.name, policies, cfg.world_sizes, cfg.microbatches, replicas=args.replicas, case=case)
    except PlanError as exc:
        raise UsageError(str(exc)) from None
    _json_target(args.json)
    odd = [w for w in cfg.world_sizes if w % args.replicas]
    if odd:
        raise UsageError(f"--replicas {args.replicas}: world size {odd[0]} is not a multiple of it")
    if cfg.zero and args.policy is None:  # no --policy: those with data-parallel ranks at every W
        policies = tuple(p for p in policies if not zero_refusal(cfg.zero, p, cfg.world_sizes, args.replicas)) \
            or policies
    for policy in policies:  # a plan with no data-parallel ranks to shard over: before any rank starts
        reason = zero_refusal(cfg.zero, policy, cfg.world_sizes, args.replicas)
        if reason:
            raise UsageError(reason)
    writer = None if args.reports is None else ReportWriter(args.reports, cfg, resume=args.resume,
                                                            command=f"model {args.name}")
    mb = f" of {cfg.microbatches} micro-batches" if cfg.microbatches > 1 else ""
    print(f"training {args.name} for {args.steps} steps{mb} under {', '.join(policies)} at world sizes "
          f"{list(cfg.world_sizes)}, dtype {cfg.dtype}, seeds {list(cfg.seeds)}", flush=True)
    missing = precheck(case.model, case.batch(0), cfg.precision)  # a bf16 kernel this device lacks: before any rank
    if missing:
        raise UsageError(f"--precision {cfg.precision}: {args.name} runs an operator without bf16 support on this "
                         f"device ({missing}); use --precision 32-true")
    rows = []
    with tempfile.TemporaryDirectory() as tmp, _gang(cfg, args) as gang, RunProgress(len(policies)) as progress:
        for policy in policies:
            label = f"model:{args.name} {policy}"
            progress.start(label)
            if args.replicas > 1:
                new = list(run_replicas(gang, args.name, (policy,), cfg, args.gen_dir or tmp, args.replicas,
                                        args.steps, bucket_bytes=args.bucket_bytes))
            else:
                new = list(run_model(gang, args.name, (policy,), cfg, args.gen_dir or tmp, args.steps,
                                     bucket_bytes=args.bucket_bytes))
            progress.done(label, new)
            rows += new
    print(table(rows))
    print(", ".join(f"{v} {k}" for k, v in summary(rows).items()))
    _write_reports(writer, rows)
    _write_json(args.json, rows)
    return 0 if all(r.ok for r in rows) else 1


TORCHPAR_REFUSED = {"replicas": 1, "microbatches": 1, "zero": 0, "precision": "32-true", "clip_grad_norm": None,
                    "recompute": "none", "bucket_bytes": None, "grad_reduce_dtype": None}
"""Options of compiled plans that a user's own parallelization does not take (their defaults)."""


def cmd_torchpar(args) -> int:
    """``verify model NAME --parallelize FILE.py:fn [--mesh SPEC]``: the user's own torch
    parallelization (:mod:`verify.cases.torchpar`) against one device."""
    if args.parallelize is None:
        raise UsageError("--mesh needs --parallelize FILE.py:fn (the compiler's policies build their own meshes)")
    if args.policy is not None:
        raise UsageError("give --policy or --parallelize, not both (--parallelize verifies your own parallelization)")
    for opt, default in TORCHPAR_REFUSED.items():
        if getattr(args, opt) != default:
            raise UsageError(f"--{opt.replace('_', '-')} applies to the compiler's policies, not to --parallelize "
                             f"(your fn sets up its own training recipe)")
    mesh = args.mesh or "tp"
    if args.world_size is None:  # a mesh of fixed sizes: its product; else 2 and 4
        dims = _torchpar_dims(mesh)
        fixed = all(s is not None for _, s in dims)
        args.world_size = [math.prod(s for _, s in dims)] if fixed else list(DEFAULT_WORLD_SIZES)
    cfg = _config(args)
    dims = _torchpar_dims(mesh, args.name, args.parallelize, cfg.world_sizes)
    _json_target(args.json)
    writer = None if args.reports is None else ReportWriter(
        args.reports, cfg, resume=args.resume, command=f"model {args.name} --parallelize {args.parallelize}")
    print(f"training {args.name} for {args.steps} steps parallelized by {args.parallelize} on a {mesh} mesh at world "
          f"sizes {list(cfg.world_sizes)}, dtype {cfg.dtype}, seeds {list(cfg.seeds)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp, _gang(cfg, args) as gang, RunProgress(1) as progress:
        label = f"model:{args.name} {args.parallelize}"
        progress.start(label)
        rows = list(run_torchpar(gang, args.name, args.parallelize, dims, cfg, args.gen_dir or tmp, args.steps))
        progress.done(label, rows)
    print(table(rows))
    print(", ".join(f"{v} {k}" for k, v in summary(rows).items()))
    _write_reports(writer, rows)
    _write_json(args.json, rows)
    return 0 if all(r.ok for r in rows) else 1


def _torchpar_dims(mesh: str, model: str | None = None, fn: str | None = None, world_sizes=()):
    """The parsed ``--mesh``; with ``model`` and ``fn``, everything :func:`check_parallelize` checks."""
    try:
        if model is None:
            return parse_mesh(mesh)
        return check_parallelize(model, fn, mesh, list(world_sizes))
    except TORCHPAR_BAD_INPUT as exc:
        raise UsageError(str(exc)) from None


def _selection(args, cfg, specs, models, torch_cases) -> tuple[list, list]:
    """(the units this run runs, the whole selection they are cut from): the default sample or
    ``--full``'s matrix (:mod:`verify.selection`), then ``--shard``'s share."""
    recipes = not (cfg.zero or cfg.precision != "32-true" or cfg.clip_grad_norm is not None or cfg.recompute != "none")
    policies = list(POLICIES)
    full = full_units([s.name for s in specs], models, policies, cfg.world_sizes, cfg.seeds,
                      list(dict.fromkeys(args.random_seeds)), args.microbatches,
                      [c for c in torch_cases if c.world_size in cfg.world_sizes], recipes, _zoo(args),
                      saved_plans() if recipes and not args.op and args.model is None else ())
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
    """The zoo architectures ``verify all`` runs: :data:`verify.selection.ZOO` unless ``--op`` or
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
    reg = _load(args.module)
    cfg = _config(args)
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
    gang = LazyGang(lambda: _gang(cfg, args), lambda g: preflight(g, to_sample, cfg, gang.planned))
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


def cmd_merge(args) -> int:
    from verify.merge import merge  # noqa: PLC0415
    try:
        shards, cases = merge(args.dirs, args.reports)
    except ShardError as exc:
        raise UsageError(str(exc)) from None
    print(f"merged {shards} shards, {cases} cases, into {args.reports}/")
    return 0


def main(argv: Sequence[str] | None = None, prepare=None) -> int:
    """``python -m verify ARGS`` in this process (the tests' entry); the shell's is :mod:`verify.__main__`.
    ``prepare(args)``: a hook run on the parsed arguments before the command (``verify.cluster`` sets
    torchrun's world size and ranks there; it may raise :class:`UsageError`)."""
    try:
        args = build_parser().parse_args(argv)
        if prepare is not None:
            prepare(args)
    except UsageError as exc:
        print(f"verify: error: {exc}", file=sys.stderr)
        return 2
    return run(args)


def run(args) -> int:
    """Run the parsed command; bad input is one line on stderr and exit 2."""
    try:
        return {"op": cmd_op, "model": cmd_model, "list": cmd_list, "all": cmd_all,
                "lint": cmd_lint, "merge": cmd_merge, "plan": cmd_plan}[args.command](args)
    except (UsageError, UnknownOpError, BadInput, AnnotationError, ReportError) as exc:
        print(f"verify: error: {exc}", file=sys.stderr)
        return 2
    except (WorldSizeError, MemoryCapError) as exc:
        print(f"verify: error: {exc}", file=sys.stderr)
        return 2
    except GangError as exc:
        print(f"verify: cannot start ranks: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("verify: interrupted; finished cases are kept", file=sys.stderr)
        return 130
