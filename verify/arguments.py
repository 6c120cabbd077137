"""The command line's parser: flags, their help and the checks of single values (one line, exit 2),
importing nothing heavy, so ``--help``, ``--version`` and parse errors answer without torch. The
commands themselves are in :mod:`verify.cli`."""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import fields

from nnscaler.recipe import Recipe, RecipeError

from verify.names import (CACHE_DIR, DTYPE_NAMES, MICROBATCH_POLICIES, OVERWRITE, PIPELINE_NAMES, POLICY_NAMES,
                          SEEDED_POLICIES, TORCHPAR_NAMES)
from verify.plan.arguments import add_plan_parser
from verify.runner.limits import DEFAULT_MEMORY_MB, max_ranks

DEFAULT_WORLD_SIZES = (2, 4)
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
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32",
                   help="dtype of the run (default float32); every case is also judged against float64")
    p.add_argument("--seed", type=_seed, nargs="+", default=[0], metavar="S", help="input seeds (default: 0)")
    p.add_argument("--timeout", type=_at_least(float, "--timeout", MIN_TIMEOUT_S), default=30.0, metavar="SECONDS",
                   help=f"time limit per operator case, at least {MIN_TIMEOUT_S:g}; a model case gets 8x (default 30)")
    p.add_argument("--rank-memory", type=_positive(float, "--rank-memory"), default=DEFAULT_MEMORY_MB, metavar="MB",
                   help=f"resident memory cap per rank; a rank past it fails its case and the ranks restart "
                        f"(default {DEFAULT_MEMORY_MB})")
    p.add_argument("--base", type=_positive(int, "--base"), default=None, help=argparse.SUPPRESS)


class _Version(argparse.Action):
    """``--version``: the installed distribution's version, looked up only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import PackageNotFoundError, version
        try:
            v = version("nnscaler-verify")
        except PackageNotFoundError:  # run from a source tree that was never installed
            v = "(not installed)"
        print(f"{parser.prog} {v}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m verify", description="Verify partitioned operators on real ranks.")
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p_op = sub.add_parser("op", help="verify one operator under every partition it admits",
                          description="Verify a registered operator NAME, or (--model M --node N) the operator N of "
                                      "model M as traced on its step-0 batch in --dtype with --seed: its annotation, "
                                      "lengths and arguments there. Localised model rows print the second form.")
    p_op.add_argument("name", nargs="?", help="a registered operator (see 'list'); leave out with --model")
    p_op.add_argument("--model", default=None, metavar="MODEL",
                      help="a model (built-in, NAME@WIDTH or FILE.py:BUILDER[@WIDTH]) whose traced operator --node to "
                           "verify")
    p_op.add_argument("--node", default=None, metavar="NODE", help="the operator's name in the traced model (linear_3)")
    _common(p_op)
    p_op.add_argument("--partition", type=_nonempty("--partition"), default=None, metavar="SPEC",
                      help="only this partition, e.g. 'm=2,k=2'")
    p_op.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON here")
    p_op.add_argument("--reports", default=None, metavar="DIR", help="also write reports here, as 'verify all' does")
    _overwrite(p_op)
    p_model = sub.add_parser("model", help="train a whole model under every policy and compare with one device")
    p_model.add_argument("name", help="a registered model (NAME, or NAME@WIDTH for the widenable ones), or "
                                      "FILE.py:BUILDER where BUILDER(seed) returns a ModelCase or (model, batch_fn); "
                                      "FILE.py:BUILDER@WIDTH calls BUILDER(seed, WIDTH). FILE's folder is on sys.path "
                                      "(its sibling modules import, as under python FILE.py)")
    _common(p_model)
    p_model.add_argument("--policy", nargs="+", default=None, metavar="POLICY",
                         help=f"built-in ({', '.join(sorted(POLICY_NAMES))}), a pipeline ({', '.join(PIPELINE_NAMES)}: "
                              "pp = one stage per rank, pp2_tp / pp2_dp = 2 stages each tp / dp over world/2 ranks, "
                              "1F1B unless _gpipe; pp_interleaved / pp_zb = 2 stages per rank; 4 micro-batches) "
                              "or FILE.py:function, your own (graph, config) -> Plan (default: every built-in)")
    p_model.add_argument("--replicas", type=_positive(int, "--replicas"), default=1, metavar="R",
                         help="plan each policy on W/R ranks and run it as R data-parallel replicas on W ranks, "
                              "each fed its share of the batch (default 1: no replicas)")
    p_model.add_argument("--steps", type=_positive(int, "--steps"), default=3, help="AdamW steps (default 3)")
    _recipes(p_model, "model")
    p_model.add_argument("--parallelize", default=None, metavar="FILE.py:FN",
                         help="verify your own torch parallelization instead of the compiler's policies: "
                              "fn(model, mesh) applies parallelize_module plans, fully_shard, a transformers tp_plan "
                              "(any mix) on the DeviceMesh the harness builds and returns the module (or "
                              "verify.torch_parallel.Parallelized(module, step_context=loss_parallel)); the batch is split over the "
                              "mesh dimensions named dp, dp_replicate, dp_shard")
    p_model.add_argument("--mesh", default=None, metavar="SPEC",
                         help="with --parallelize: the mesh's dimension names and sizes, NAME (1-D over the world "
                              "size; default tp) or up to 4 of NAME=N (e.g. dp=2,tp=2 or dp_replicate=2,dp_shard=2,tp=2; world "
                              "size their product)")
    p_model.add_argument("--gen-dir", default=None, metavar="DIR", help="keep the generated programs here")
    p_model.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON here")
    p_model.add_argument("--reports", default=None, metavar="DIR", help="also write reports here, as 'verify all' does")
    _overwrite(p_model)
    p_list = sub.add_parser("list", help="list registered operators with their annotations")
    _common(p_list, run=False)
    p_lint = sub.add_parser("lint", help="check annotations for likely mistakes before any rank runs")
    p_lint.add_argument("names", nargs="*", metavar="NAME", help="operators to check (default: every registered one)")
    _common(p_lint, run=False)
    p_lint.add_argument("--static", action="store_true", help="annotation-only checks (do not run the functions)")
    p_all = sub.add_parser("all", help="verify every registered operator and write reports/")
    _common(p_all)
    p_all.add_argument("--reports", default="reports", metavar="DIR", help="report directory (default reports/)")
    keep = p_all.add_mutually_exclusive_group()
    keep.add_argument("--resume", action="store_true", help="keep rows already in DIR/cases.jsonl, run the rest")
    _overwrite(keep)
    p_all.add_argument("--op", nargs="+", default=None, metavar="NAME", help="only these operators")
    p_all.add_argument("--model", nargs="*", default=None, metavar="NAME",
                       help="whole models to train under every policy (default: all, or none with --op; none with an "
                            "empty list)")
    p_all.add_argument("--microbatches", type=_positive(int, "--microbatches"), nargs="*", default=[4], metavar="M",
                       help=f"also train every model under {' and '.join(MICROBATCH_POLICIES)} with M micro-batches per "
                            "step, for each M (default: 4; none with an empty list)")
    p_all.add_argument("--random-seeds", type=int, nargs="+", default=[0, 1, 2], metavar="S",
                       help=f"seeds of the seeded policies ({', '.join(SEEDED_POLICIES)}) for whole models, each a "
                            "different plan (default: 0 1 2)")
    _recipes(p_all, "all")
    p_all.add_argument("--torchpar", nargs="*", default=None, metavar="NAME",
                       help="built-in torch parallelizations to verify, a section of their own (torchtitan's Llama "
                            "plan, FSDP2, FSDP2 x TP, transformers' tp_plan, known-wrong plans): "
                            f"{', '.join(TORCHPAR_NAMES)} (default: all, or none with --op or "
                            "--model; none with an empty list)")
    p_all.add_argument("--full", action="store_true",
                       help="run the whole matrix (every model x policy x world size x seed, every random seed, "
                            "micro-batch count, pipeline, replica and recipe case, each resuming from its checkpoint) "
                            "instead of the default sample, which runs each of those at least once")
    p_all.add_argument("--shard", default=None, metavar="I/N",
                       help="run share I of N (time-balanced by recorded unit times, the same on every machine); "
                            "combine the N report directories with 'python -m verify merge'")
    p_all.add_argument("--no-cache", action="store_true",
                       help="run every unit, ignoring verdicts kept in the cache (a cached row says so in reports)")
    p_all.add_argument("--cache-dir", default=CACHE_DIR, metavar="DIR",
                       help=f"where verdicts are kept, keyed by everything that can change them (default {CACHE_DIR})")
    p_merge = sub.add_parser("merge", help="combine the reports of the N shards of one 'verify all --shard i/N' sweep",
                             description="Check that the report directories are the N shares of one verify all "
                                         "--shard sweep, each once, no unit or case missing or twice, and write "
                                         "the combined reports (cases.jsonl, JSON, Markdown, JUnit, HTML).")
    p_merge.add_argument("dirs", nargs="+", metavar="DIR", help="the shards' --reports directories")
    p_merge.add_argument("--reports", default="reports", metavar="DIR", help="where to write (default reports/)")
    add_plan_parser(sub)
    return parser


def _overwrite(p) -> None:
    """``--overwrite``: ``args.resume`` becomes :data:`OVERWRITE` (what ``ReportWriter(resume=...)`` takes)."""
    p.add_argument("--overwrite", dest="resume", action="store_const", const=OVERWRITE, default=False,
                   help="replace the rows already in the --reports directory (without it, only a finished run of "
                        "the same command at the same settings is replaced, and a line says so; any other is "
                        "refused)")


RECIPE_TYPES = {"int": int, "float": float, "str": None}
"""A recipe field's type (the first name of its annotation) -> the flag's value type (``None``: the text)."""


def recipe_fields(command: str) -> list:
    """The fields of :class:`nnscaler.recipe.Recipe` that ``verify COMMAND`` offers as flags."""
    return [f for f in fields(Recipe) if command in f.metadata["commands"]]


def recipe_dest(f) -> str:
    """The ``args`` attribute of a recipe field's flag (``--clip-grad-norm``: ``clip_grad_norm``)."""
    return f.metadata["flag"][2:].replace("-", "_")


def _recipes(p: argparse.ArgumentParser, command: str) -> None:
    """The training-recipe flags of whole-model runs, generated from the fields of
    :class:`nnscaler.recipe.Recipe` (flag, type, default, help from each field; carried into
    ``ComputeConfig``; the single-device reference runs the same recipe)."""
    for f in recipe_fields(command):
        meta, flag = f.metadata, f.metadata["flag"]
        kind = RECIPE_TYPES[f.type.split("|")[0].strip()]
        kwargs = {"type": _positive(kind, flag) if meta.get("positive") else kind, "choices": meta.get("choices"),
                  "metavar": meta.get("metavar")}
        p.add_argument(flag, default=f.default, help=meta.get(f"help_{command}", meta["help"]),
                       **{k: v for k, v in kwargs.items() if v is not None})


def check_recipe(args) -> Recipe:
    """The recipe the command's flags ask for (:class:`nnscaler.recipe.Recipe`), each bad value one
    line naming its flag; whether this device runs bf16 is :func:`verify.options.run_config`'s check."""
    values = {f.name: getattr(args, recipe_dest(f)) for f in recipe_fields(getattr(args, "command", ""))
              if hasattr(args, recipe_dest(f))}  # the recipe flags this command offers (verify/arguments.py)
    precision = values.get("precision", "32-true")
    try:
        Recipe(precision=precision).check()
    except RecipeError as exc:
        raise UsageError(str(exc)) from None
    if precision != "32-true" and args.dtype != "float32":
        raise UsageError(f"--precision {precision} sets the dtypes itself; leave --dtype at float32 (got {args.dtype})")
    if values.get("grad_reduce_dtype") and precision != "bf16-mixed":
        raise UsageError("--grad-reduce-dtype needs --precision bf16-mixed")
    zero = values.get("zero", 0)
    try:
        Recipe(zero=zero).check()
    except RecipeError as exc:
        raise UsageError(f"--zero {zero}: {exc}") from None
    try:
        recipe = Recipe(**values)
        recipe.check()
    except RecipeError as exc:
        raise UsageError(str(exc)) from None
    return recipe
