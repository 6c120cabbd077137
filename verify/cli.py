"""``python -m verify``: ``op NAME``, ``model NAME``, ``list``, ``lint`` and ``all``.

Exit codes: 0 every row matched, 1 some row failed (mismatch, error, timeout, crash), 2 bad input
(unknown operator, bad flag, malformed annotation), with one line on stderr.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
import json
import math
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from tabulate import tabulate

from nnscaler.dimops.grammar import AnnotationError
from nnscaler.ops.registry import OpRegistry, UnknownOpError

from nnscaler.config import ComputeConfig
from nnscaler.policies import POLICIES, PlanError

from verify.cases.config import BadInput, Row, RunConfig, model_label
from verify.judge.lowprec import precheck
from verify.judge.verdict import MISMATCH

from verify.sweep import preflight, run_model, run_op
from verify.lint import lint
from verify.cases.model import PolicyFileError, resolve_policy
from verify.cases.pipeline import PIPELINE_MICROBATCHES, PIPELINE_MODELS, PIPELINE_POLICIES, SWEPT, check_pipeline_input
from verify.cases.coverage import replicated_lines
from verify.cases.node import UnknownNode, model_graph, node_op
from verify.models.registry import MODELS
from verify.models.loader import build_model, known_model
from verify.models.registry import ModelCase
from verify.models.loader import ModelNotFound, check_builder, is_file_reference
from verify.runner.gang import DEFAULT_MEMORY_MB, PG_TIMEOUT_S, Gang, GangError, MemoryCapError, WorldSizeError, max_ranks
from verify.report.progress import RunProgress
from verify.cases.replica_rows import replica_items, run_replicas
from verify.cases.zero import zero_refusal
from verify.cases.torchpar_mesh import parse_mesh
from verify.cases.torchpar_builtin import CASES as TORCH_CASES, run_builtin
from verify.cases.torchpar_rows import BAD_INPUT as TORCHPAR_BAD_INPUT, check_parallelize, run_torchpar
from verify.report.writer import ReportError, ReportWriter, summary, table
from verify.cases.samples import DTYPES
from verify.worker import load_modules



DEFAULT_WORLD_SIZES = (2, 4)
MICROBATCH_POLICIES = ("dp", "tp")  # the micro-batch sweep of `verify all`
SEEDED_POLICIES = ("random", "random2d", "pp2_random")  # each seed draws another plan
"""Policies whose plan is drawn from the seed: ``verify all`` runs each under every ``--random-seeds``."""


class UsageError(Exception):
    """Bad input: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        raise UsageError(message)


def _world_size(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"world size must be an integer, got {text!r}") from None
    if not 1 <= n <= max_ranks():
        raise argparse.ArgumentTypeError(f"world size must be between 1 and {max_ranks()} on this machine "
                                         f"({os.cpu_count()} cores), got {n}")
    return n


def _positive(kind: type, what: str):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a {kind.__name__}, got {text!r}") from None
        if not (math.isfinite(v) and v > 0):
            raise argparse.ArgumentTypeError(f"{what} must be a finite number above 0, got {text!r}")
        return v
    return parse


MIN_TIMEOUT_S = 1.0  # below this a limit cannot apply: starting a case's collectives alone takes longer
MAX_SEED = 2 ** 63 - 1  # torch.manual_seed takes seeds up to this


def _at_least(kind: type, what: str, least: float):
    positive = _positive(kind, what)

    def parse(text: str):
        v = positive(text)
        if v < least:
            raise argparse.ArgumentTypeError(f"{what} must be at least {least:g}, got {text!r}")
        return v
    return parse


def _nonempty(what: str):
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{what} must not be empty (e.g. 'm=2,k=2')")
        return text
    return parse


def _seed(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seed must be an integer, got {text!r}") from None
    if not 0 <= v <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"--seed must be between 0 and {MAX_SEED}, got {text}")
    return v


def _common(p: argparse.ArgumentParser, run: bool = True) -> None:
    p.add_argument("--module", action="append", default=[], metavar="FILE.py",
                   help="import this file first so its register_op calls take effect (repeatable)")
    if not run:
        return
    p.add_argument("--world-size", type=_world_size, nargs="+", default=None, metavar="N",
                   help="world sizes to verify at (default: 2 4; with --mesh of fixed sizes, their product)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="dtype of the run (default float32); every case is also judged against float64")
    p.add_argument("--seed", type=_seed, nargs="+", default=[0], metavar="S", help="input seeds (default: 0)")
    p.add_argument("--timeout", type=_at_least(float, "--timeout", MIN_TIMEOUT_S), default=30.0, metavar="SECONDS",
                   help=f"time limit per operator case, at least {MIN_TIMEOUT_S:g}; a model case gets 8x (default 30)")
    p.add_argument("--rank-memory", type=_positive(float, "--rank-memory"), default=DEFAULT_MEMORY_MB, metavar="MB",
                   help=f"resident memory cap per rank; a rank past it fails its case and the ranks restart "
                        f"(default {DEFAULT_MEMORY_MB})")
    p.add_argument("--base", type=_positive(int, "--base"), default=None, help=argparse.SUPPRESS)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("nnscaler-verify")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def _precision_name(text: str) -> str:
    try:  # the compiler's own check: an unknown name, or bf16 on a device without it, in one line
        ComputeConfig(1, precision=text)
    except PlanError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _precision(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", type=_precision_name, default="32-true", metavar="RECIPE",
                   help="whole models: 32-true (default), bf16-mixed (bf16 compute as under torch.autocast, fp32 "
                        "master weights) or bf16-true, each against the single-device run of the same recipe "
                        "(bound: verify/judge/compare.py)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m verify", description="Verify partitioned operators on real ranks.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p_op = sub.add_parser("op", help="verify one operator under every partition it admits",
                          description="Verify a registered operator NAME, or (--model M --node N) the operator N of "
                                      "model M as traced on its step-0 batch in --dtype with --seed: its annotation, "
                                      "lengths and arguments there. Localised model rows print the second form.")
    p_op.add_argument("name", nargs="?", help="a registered operator (see 'list'); leave out with --model")
    p_op.add_argument("--model", default=None, metavar="MODEL",
                      help="a model (built-in, NAME@WIDTH or FILE.py:BUILDER) whose traced operator --node to verify")
    p_op.add_argument("--node", default=None, metavar="NODE", help="the operator's name in the traced model (linear_3)")
    _common(p_op)
    p_op.add_argument("--partition", type=_nonempty("--partition"), default=None, metavar="SPEC",
                      help="only this partition, e.g. 'm=2,k=2'")
    p_op.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON here")
    p_op.add_argument("--reports", default=None, metavar="DIR", help="also write reports here, as 'verify all' does")
    p_model = sub.add_parser("model", help="train a whole model under every policy and compare with one device")
    p_model.add_argument("name", help="a registered model (see --help of 'all') or FILE.py:BUILDER")
    _common(p_model)
    p_model.add_argument("--policy", nargs="+", default=list(POLICIES), metavar="POLICY",
                         help=f"built-in ({', '.join(sorted(POLICIES))}), a pipeline ({', '.join(PIPELINE_POLICIES)}: "
                              "pp = one stage per rank, pp2_tp / pp2_dp = 2 stages each tp / dp over world/2 ranks, "
                              "1F1B unless _gpipe; pp_interleaved / pp_zb = 2 stages per rank; 4 micro-batches) "
                              "or FILE.py:function, your own (graph, config) -> Plan (default: every built-in)")
    p_model.add_argument("--bucket-bytes", type=_positive(int, "--bucket-bytes"), default=None, metavar="N",
                         help="gradient-sync bucket size of the compiled module (default: the model's, else 4 MiB)")
    p_model.add_argument("--replicas", type=_positive(int, "--replicas"), default=1, metavar="R",
                         help="plan each policy on W/R ranks and run it as R data-parallel replicas on W ranks, "
                              "each fed its share of the batch (default 1: no replicas)")
    p_model.add_argument("--steps", type=_positive(int, "--steps"), default=3, help="AdamW steps (default 3)")
    p_model.add_argument("--microbatches", type=_positive(int, "--microbatches"), default=1, metavar="M",
                         help="train each step by train_step in M micro-batches (M of the model's batches stacked), "
                              "against one device on the whole batch (default 1: plain forward and backward)")
    _recipes(p_model)
    _precision(p_model)
    p_model.add_argument("--grad-reduce-dtype", choices=["fp32", "bf16"], default=None,
                         help="with --precision bf16-mixed: the dtype gradients are reduced in (default fp32)")
    p_model.add_argument("--zero", type=int, default=0, metavar="Z",
                         help="ZeRO stage over the data-parallel ranks (dp, hybrid's dp axis, --replicas): 1 shards "
                              "optimizer state, 2 also gradients (default 0)")
    p_model.add_argument("--parallelize", default=None, metavar="FILE.py:FN",
                         help="verify your own torch parallelization instead of the compiler's policies: "
                              "fn(model, mesh) applies parallelize_module plans, fully_shard, a transformers tp_plan "
                              "(any mix) on the DeviceMesh the harness builds and returns the module (or "
                              "verify.torch_parallel.Parallelized(module, step_context=loss_parallel)); the batch is split over the "
                              "mesh dimension named dp")
    p_model.add_argument("--mesh", default=None, metavar="SPEC",
                         help="with --parallelize: the mesh's dimension names and sizes, NAME (1-D over the world "
                              "size; default tp) or NAME=N,NAME=M (2-D, e.g. dp=2,tp=2; world size their product)")
    p_model.add_argument("--gen-dir", default=None, metavar="DIR", help="keep the generated programs here")
    p_model.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON here")
    p_model.add_argument("--reports", default=None, metavar="DIR", help="also write reports here, as 'verify all' does")
    p_list = sub.add_parser("list", help="list registered operators with their annotations")
    _common(p_list, run=False)
    p_lint = sub.add_parser("lint", help="check annotations for likely mistakes before any rank runs")
    p_lint.add_argument("names", nargs="*", metavar="NAME", help="operators to check (default: every registered one)")
    _common(p_lint, run=False)
    p_lint.add_argument("--static", action="store_true", help="annotation-only checks (do not run the functions)")
    p_all = sub.add_parser("all", help="verify every registered operator and write reports/")
    _common(p_all)
    p_all.add_argument("--reports", default="reports", metavar="DIR", help="report directory (default reports/)")
    p_all.add_argument("--resume", action="store_true", help="keep rows already in DIR/cases.jsonl, run the rest")
    p_all.add_argument("--op", nargs="+", default=None, metavar="NAME", help="only these operators")
    p_all.add_argument("--model", nargs="*", default=None, metavar="NAME",
                       help="whole models to train under every policy (default: all, or none with --op; none with an "
                            "empty list)")
    p_all.add_argument("--microbatches", type=_positive(int, "--microbatches"), nargs="*", default=[4], metavar="M",
                       help=f"also train every model under {' and '.join(MICROBATCH_POLICIES)} with M micro-batches per "
                            "step, for each M (default: 4; none with an empty list)")
    _precision(p_all)
    p_all.add_argument("--zero", type=int, default=0, metavar="Z",
                       help="train the models under ZeRO stage Z where a plan has data-parallel ranks (dp, hybrid at "
                            "W>=4, the tp replicas rows); the other model rows are left out (default 0)")
    p_all.add_argument("--random-seeds", type=int, nargs="+", default=[0, 1, 2], metavar="S",
                       help=f"seeds of the seeded policies ({', '.join(SEEDED_POLICIES)}) for whole models, each a "
                            "different plan (default: 0 1 2)")
    _recipes(p_all)
    p_all.add_argument("--torchpar", nargs="*", default=None, metavar="NAME",
                       help="built-in torch parallelizations to verify, a section of their own (torchtitan's Llama "
                            "plan, FSDP2, FSDP2 x TP, transformers' tp_plan, known-wrong plans): "
                            f"{', '.join(sorted({c.name for c in TORCH_CASES}))} (default: all, or none with --op or "
                            "--model; none with an empty list)")
    return parser


def _recipes(p: argparse.ArgumentParser) -> None:
    """The training-recipe flags of whole-model runs (carried into ``ComputeConfig``; the single-device
    reference runs the same recipe)."""
    p.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX",
                   help="clip the whole model's gradient norm to MAX each step (ComputeConfig.clip_grad_norm; "
                        "the reference uses torch.nn.utils.clip_grad_norm_)")
    p.add_argument("--recompute", default="none", metavar="MODE",
                   help="activation recompute: none (default), full (each block), selective (attention core)")


def _config(args) -> RunConfig:
    if args.world_size is None:
        args.world_size = list(DEFAULT_WORLD_SIZES)
    if args.base is not None and any(args.base % w for w in args.world_size):
        raise UsageError(f"--base {args.base} is not a multiple of every world size {args.world_size}")
    microbatches = getattr(args, "microbatches", 1)
    precision = getattr(args, "precision", "32-true")
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


def _load(modules: Sequence[str]) -> OpRegistry:
    for m in modules:
        if not Path(m).is_file():
            raise UsageError(f"--module {m}: no such file")
    try:
        return load_modules(modules)
    except AnnotationError as exc:
        raise UsageError(str(exc)) from None
    except SystemExit as exc:
        raise UsageError(f"importing {', '.join(modules)} called sys.exit({exc.code!r})") from None
    except Exception as exc:
        raise UsageError(f"importing {', '.join(modules)} failed: {type(exc).__name__}: {exc}") from None


def _gang(cfg: RunConfig, args) -> Gang:
    """The ranks for ``cfg``: gloo's own timeout stays far above the longest case limit."""
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
    reg = _load(args.module)
    rows = [[s.name, s.family, s.annotation, ", ".join(s.aten)] for s in reg]
    print(tabulate(rows, headers=["op", "family", "annotation", "aten"], tablefmt="github"))
    print(f"\n{len(rows)} operators")
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
    if is_file_reference(name):
        try:
            return check_builder(name)  # exists, returns a case, its batch fits: before any rank starts
        except ModelNotFound as exc:
            raise UsageError(str(exc)) from None
    if not known_model(name):
        raise UsageError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))} (or NAME@WIDTH, or "
                         f"FILE.py:BUILDER where BUILDER(seed) returns a ModelCase or (model, batch_fn))")
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
    reg = _load(args.module)
    cfg = _config(args)
    wrong_backward: list[Row] = []
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
                print(f"verify: warning: {finding}", file=sys.stderr)
    _json_target(args.json)
    writer = None if args.reports is None else ReportWriter(args.reports, cfg)  # refuses an unwritable directory
    print(f"verifying {what} `{spec.annotation}` at world sizes {list(cfg.world_sizes)}, "
          f"dtype {cfg.dtype}, seeds {list(cfg.seeds)}", flush=True)
    rows = list(wrong_backward)
    with _gang(cfg, args) as gang, RunProgress(len(cfg.world_sizes)) as progress:
        preflight(gang, [spec], cfg)
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
    policies = _policies(args.policy)
    cfg = _config(args)
    try:  # a pipeline the model cannot be cut into, or a batch that does not divide: before any rank starts
        check_pipeline_input(args.name, policies, cfg.world_sizes, cfg.microbatches, replicas=args.replicas, case=case)
    except PlanError as exc:
        raise UsageError(str(exc)) from None
    _json_target(args.json)
    odd = [w for w in cfg.world_sizes if w % args.replicas]
    if odd:
        raise UsageError(f"--replicas {args.replicas}: world size {odd[0]} is not a multiple of it")
    if cfg.zero and args.policy == list(POLICIES):  # no --policy: those with data-parallel ranks at every W
        policies = tuple(p for p in policies if not zero_refusal(cfg.zero, p, cfg.world_sizes, args.replicas)) \
            or policies
    for policy in policies:  # a plan with no data-parallel ranks to shard over: before any rank starts
        reason = zero_refusal(cfg.zero, policy, cfg.world_sizes, args.replicas)
        if reason:
            raise UsageError(reason)
    writer = None if args.reports is None else ReportWriter(args.reports, cfg)
    mb = f" of {cfg.microbatches} micro-batches" if cfg.microbatches > 1 else ""
    print(f"training {args.name} for {args.steps} steps{mb} under {', '.join(policies)} at world sizes "
          f"{list(cfg.world_sizes)}, dtype {cfg.dtype}, seeds {list(cfg.seeds)}", flush=True)
    for line in replicated_lines(args.name, [p for p in policies if p in POLICIES], cfg.world_sizes, case=case):
        print(line, flush=True)
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
    if args.policy != list(POLICIES):
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
    writer = None if args.reports is None else ReportWriter(args.reports, cfg)
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


RECIPE = {"precision": "bf16-mixed", "zero": 3, "recompute": "full", "clip_grad_norm": 1.0}  # verify all's sample
RECIPE_TAG = " bf16-mixed zero3 clip1 recompute=full"
RECIPE_MODELS = ("nanogpt", "llama")


def recipe_items(models, cfg) -> list:
    """``verify all``'s training-recipe rows, when it runs none itself (no recipe flag): the recipes
    combined (:data:`RECIPE`) on nanoGPT and Llama under dp at every world size, hybrid at W>=4 and tp
    as 2 replicas at W>=4 (zero on the replica axis): a few rows, not the whole sweep again."""
    if cfg.zero or cfg.precision != "32-true" or cfg.clip_grad_norm is not None or cfg.recompute != "none":
        return []
    out = []
    for m in (m for m in RECIPE_MODELS if m in models):
        out.append((f"model:{m} dp{RECIPE_TAG}", (m, "dp", 1, cfg.world_sizes)))
        big = tuple(w for w in cfg.world_sizes if w >= 4)
        if big:
            out.append((f"model:{m} hybrid{RECIPE_TAG}", (m, "hybrid", 1, big)))
            out.append((f"model:{m} tp x2 replicas{RECIPE_TAG}", (m, "tp", 2, tuple(w for w in big if w % 2 == 0))))
    return out


def cmd_all(args) -> int:
    reg = _load(args.module)
    cfg = _config(args)
    specs = [reg.get(n) for n in args.op] if args.op else list(reg)
    unknown = [m for m in args.model or () if not known_model(m)]
    if unknown:
        raise UsageError(f"unknown model {unknown[0]!r}; known: {', '.join(sorted(MODELS))}")
    writer = ReportWriter(args.reports, cfg, resume=args.resume)  # refuses a busy or unwritable directory
    done = writer.done()
    gang = None
    start = time.perf_counter()
    print(f"verifying {len(specs)} operators at world sizes {list(cfg.world_sizes)}, dtype {cfg.dtype}, "
          f"seeds {list(cfg.seeds)}; reports in {args.reports}/", flush=True)
    models = (sorted(MODELS) if not args.op else []) if args.model is None else args.model
    replicas = replica_items(models, cfg.world_sizes)  # a tp plan as data-parallel replicas, every model
    if cfg.precision != "32-true":  # replica cases run 32-true only: left out rather than mislabelled
        replicas = []
    random_cfg = replace(cfg, seeds=tuple(dict.fromkeys(args.random_seeds)))
    torch_names = args.torchpar if args.torchpar is not None else \
        ([] if args.op or args.model is not None else sorted({c.name for c in TORCH_CASES}))
    unknown = sorted(set(torch_names) - {c.name for c in TORCH_CASES})
    if unknown:
        raise UsageError(f"--torchpar {unknown[0]}: no such case; known: {', '.join(sorted({c.name for c in TORCH_CASES}))}")
    torch_cases = [(f"torchpar:{c.name} W={c.world_size}", c) for c in TORCH_CASES
                   if c.name in torch_names and c.world_size in cfg.world_sizes]
    items = [(spec.name, spec) for spec in specs] + [(f"model:{m} {p}", (m, p, 1)) for m in models for p in POLICIES]
    items += [(f"model:{m} {model_label(p, k)}", (m, p, k)) for k in dict.fromkeys(args.microbatches) if k > 1
              for m in models for p in MICROBATCH_POLICIES]
    items += [(f"model:{m} {model_label(p, PIPELINE_MICROBATCHES)}", (m, p, PIPELINE_MICROBATCHES))
              for m in models if m in PIPELINE_MODELS for p in SWEPT]  # pipelines: 1F1B and GPipe, each mesh
    recipes = recipe_items(models, cfg)  # the training recipes combined, sampled: a few rows

    try:
        with _gang(cfg, args) as gang, tempfile.TemporaryDirectory() as tmp, \
                RunProgress(len(items) + len(replicas) + len(recipes) + len(torch_cases)) as progress:
            preflight(gang, specs, cfg)

            def record(label, rows):  # each row is written the moment it is known
                new = []
                for row in rows:
                    writer.add(row)
                    new.append(row)
                progress.done(label, new)
                writer.seconds = time.perf_counter() - start
                writer.flush()

            for label, item in items:
                progress.start(label)
                if isinstance(item, tuple):
                    name, policy, k = item  # each seed of a seeded policy draws another plan
                    record(label, run_model(gang, name, (policy,), replace(
                        random_cfg if policy in SEEDED_POLICIES else cfg, microbatches=k), tmp, skip=done))
                else:
                    record(label, run_op(gang, item, cfg, skip=done))
            for label, (name, policy, r, sizes) in replicas + recipes:
                progress.start(label)
                run_cfg = replace(cfg, world_sizes=sizes, **(RECIPE if label.endswith(RECIPE_TAG) else {}))
                record(label, run_replicas(gang, name, (policy,), run_cfg, tmp, r, skip=done) if r > 1
                       else run_model(gang, name, (policy,), run_cfg, tmp, skip=done))
            for label, case in torch_cases:  # the section of torch's own parallelizations
                progress.start(label)
                record(label, run_builtin(gang, case, cfg, tmp, skip=done))
    finally:
        writer.seconds = time.perf_counter() - start
        writer.close()
    failed = [r for r in writer.rows if not r.ok]
    if failed:
        print(table(failed, with_op=True))
    s = summary(writer.rows)
    print(", ".join(f"{v} {k}" for k, v in s.items()) + f" in {writer.seconds:.1f} s; gang started {gang.starts if gang else 0}x")
    return 0 if not failed else 1


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return {"op": cmd_op, "model": cmd_model, "list": cmd_list, "all": cmd_all,
                "lint": cmd_lint}[args.command](args)
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
