"""What every command of ``python -m verify`` makes of its arguments before a rank starts: the run's
:class:`RunConfig` (bad values: one :class:`UsageError` line), the registry with the ``--module`` files
imported (their warnings said once, at the user's line) and the ranks a run uses."""
from __future__ import annotations

import sys
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from nnscaler.config import ComputeConfig
from nnscaler.dimops.grammar import AnnotationError
from nnscaler.ops.registry import OpRegistry
from nnscaler.policies import PlanError

from verify.arguments import DEFAULT_WORLD_SIZES, UsageError, check_recipe
from verify.config import RunConfig
from verify.runner.gang import PG_TIMEOUT_S, Gang
from verify.runner.worker import load_modules


def run_config(args) -> RunConfig:
    if args.world_size is None:
        args.world_size = list(DEFAULT_WORLD_SIZES)
    if args.base is not None and any(args.base % w for w in args.world_size):
        raise UsageError(f"--base {args.base} is not a multiple of every world size {args.world_size}")
    recipe = check_recipe(args)  # each bad value one line naming its flag (verify/arguments.py)
    try:  # the compiler's own check: bf16 on a device without it, in one line
        ComputeConfig(1, precision=recipe.precision)
    except PlanError as exc:
        raise UsageError(str(exc)) from None
    return RunConfig(recipe=recipe, world_sizes=tuple(dict.fromkeys(args.world_size)), dtype=args.dtype,
                     seeds=tuple(args.seed), modules=tuple(args.module), timeout_s=args.timeout,
                     partition=getattr(args, "partition", None), base_override=args.base)


def imported(modules: Sequence[str]) -> tuple[OpRegistry, list[warnings.WarningMessage]]:
    """The registry with ``modules`` imported, and what their import warned of, not yet shown (input
    refused later is one line, with no warnings before it): :func:`say` shows them."""
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


def say(caught: Sequence[warnings.WarningMessage], findings: Sequence = ()) -> None:
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


def load_registry(modules: Sequence[str]) -> OpRegistry:
    reg, caught = imported(modules)
    say(caught)
    return reg


def gang_for(cfg: RunConfig, args) -> Gang:
    """The ranks for ``cfg``: gloo's own timeout stays far above the longest case limit; under
    ``verify.cluster``, the torchrun job's ranks (``args.ranks``, set by its ``prepare``)."""
    if getattr(args, "ranks", None) is not None:
        return args.ranks
    sweep = getattr(args, "microbatches", 1)  # `all`: a list of micro-batch counts; the longest case sets the limit
    most = max([cfg.microbatches, *sweep]) if isinstance(sweep, list) else cfg.microbatches
    longest = replace(cfg, microbatches=most).limit_s("model", getattr(args, "steps", 3))
    return Gang(max(cfg.world_sizes), cfg.modules, cfg.world_sizes, memory_mb=args.rank_memory,
                pg_timeout_s=max(PG_TIMEOUT_S, 2 * longest))
