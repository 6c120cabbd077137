"""``python -m verify``: ``op NAME``, ``model NAME``, ``list``, ``lint``, ``merge``, ``all``
(:mod:`verify.sweep.command`) and ``plan PATH`` (:mod:`verify.plan.cli`).

Exit codes: 0 every row matched, 1 some row failed (mismatch, error, timeout, crash), 2 bad input
(unknown operator, bad flag, malformed annotation), with one line on stderr.
"""
from __future__ import annotations

from dataclasses import replace
import json
import math
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Sequence


from nnscaler.dimops.grammar import AnnotationError
from nnscaler.ops.lint import AnnotationWarning
from nnscaler.ops.registry import UnknownOpError

from nnscaler.policies import POLICIES, PlanError

from verify.config import BadInput, RunConfig

from verify.judge.row import Row
from verify.judge.lowprec import precheck
from verify.judge.verdict import MISMATCH

from verify.rows.run import preflight, run_model, run_op
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
from verify.runner.gang import GangError, MemoryCapError, WorldSizeError
from verify.report.progress import RunProgress
from verify.rows.replicas import run_replicas
from verify.sweep.shard import ShardError
from verify.cases.zero import zero_refusal
from verify.cases.torchpar.mesh import parse_mesh
from verify.rows.torchpar import BAD_INPUT as TORCHPAR_BAD_INPUT, check_parallelize, run_torchpar
from verify.report.writer import ReportError, ReportWriter, summary, table
from verify.arguments import DEFAULT_WORLD_SIZES, UsageError, build_parser, recipe_dest, recipe_fields
from verify.names import POLICY_NAMES, SEQUENCE_POLICIES
from verify.plan.cli import cmd_plan
from verify.sweep.command import cmd_all
from verify.options import gang_for, imported, load_registry, run_config, say



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


def _catalogue_rows(reg, key: str | None) -> list[list[str]]:
    """The catalogue's rows, kept under ``key`` (the source before the import; None: not kept), so the
    next plain ``list`` and an unknown operator's line answer without torch (verify/__main__.py)."""
    rows = [[s.name, s.family, s.annotation, ", ".join(s.aten)] for s in reg]
    store_rows(key, rows)
    return rows


def cmd_list(args) -> int:
    key = None if args.module else current_key()  # read before the import: the rows belong to this source
    print(render(_catalogue_rows(load_registry(args.module), key)))
    return 0


def cmd_lint(args) -> int:
    reg = load_registry(args.module)
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
    key = None if args.module else current_key()
    reg, caught = imported(args.module)  # said once the operator's input passed the checks (preflight)
    if key is not None:
        _catalogue_rows(reg, key)
    cfg = run_config(args)
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
    with gang_for(cfg, args) as gang, RunProgress(len(cfg.world_sizes)) as progress:
        preflight(gang, [spec], cfg)
        say(caught, notes)
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
    load_registry(args.module)
    case = _check_model(args.name, build=True)  # the one build before the ranks start
    if args.parallelize is not None or args.mesh is not None:
        return cmd_torchpar(args)
    policies = _policies(args.policy or [p for p in POLICY_NAMES if p not in SEQUENCE_POLICIES])  # no --policy: all but cp
    cfg = run_config(args)
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
    settings = {"policies": list(policies), "steps": args.steps, "replicas": args.replicas,
                **cfg.recipe.to_dict()}  # every recipe field, each a setting of its own
    writer = None if args.reports is None else ReportWriter(args.reports, cfg, resume=args.resume,
                                                            command=f"model {args.name}", settings=settings)
    mb = f" of {cfg.microbatches} micro-batches" if cfg.microbatches > 1 else ""
    print(f"training {args.name} for {args.steps} steps{mb} under {', '.join(policies)} at world sizes "
          f"{list(cfg.world_sizes)}, dtype {cfg.dtype}, seeds {list(cfg.seeds)}", flush=True)
    missing = precheck(case.model, case.batch(0), cfg.precision)  # a bf16 kernel this device lacks: before any rank
    if missing:
        raise UsageError(f"--precision {cfg.precision}: {args.name} runs an operator without bf16 support on this "
                         f"device ({missing}); use --precision 32-true")
    rows = []
    with tempfile.TemporaryDirectory() as tmp, gang_for(cfg, args) as gang, RunProgress(len(policies)) as progress:
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


TORCHPAR_REFUSED = {"replicas": 1, **{recipe_dest(f): f.default for f in recipe_fields("model")}}
"""Options of compiled plans that a user's own parallelization does not take (their defaults)."""


def cmd_torchpar(args) -> int:
    """``verify model NAME --parallelize FILE.py:fn [--mesh SPEC]``: the user's own torch
    parallelization (:mod:`verify.cases.torchpar.case`) against one device."""
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
    cfg = run_config(args)
    dims = _torchpar_dims(mesh, args.name, args.parallelize, cfg.world_sizes)
    _json_target(args.json)
    writer = None if args.reports is None else ReportWriter(
        args.reports, cfg, resume=args.resume, command=f"model {args.name} --parallelize {args.parallelize}",
        settings={"mesh": mesh, "steps": args.steps})
    print(f"training {args.name} for {args.steps} steps parallelized by {args.parallelize} on a {mesh} mesh at world "
          f"sizes {list(cfg.world_sizes)}, dtype {cfg.dtype}, seeds {list(cfg.seeds)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp, gang_for(cfg, args) as gang, RunProgress(1) as progress:
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


def cmd_merge(args) -> int:
    from verify.sweep.merge import merge  # noqa: PLC0415
    try:
        shards, rows = merge(args.dirs, args.reports)
    except ShardError as exc:
        raise UsageError(str(exc)) from None
    failed = [r for r in rows if not r.ok]  # exit as `verify all` would on these rows
    if failed:
        print(table(failed, with_op=True))
    print(", ".join(f"{v} {k}" for k, v in summary(rows).items()))
    print(f"merged {shards} shards, {len(rows)} cases, into {args.reports}/")
    return 1 if failed else 0


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
