"""Checks of the parsed command line that need neither torch nor the ranks: an unknown policy, model or
operator, a recipe value out of range, a ``--shard`` that cannot be. :mod:`verify.__main__` runs them
before it imports :mod:`verify.cli`, so such a mistake is one line within a second, not after torch,
the model build and the gang; each line is the one the full check in :mod:`verify.cli` prints. What
cannot be told cheaply is left to that check: names a ``--module`` file may register, operators
while the catalogue's cache (:mod:`verify.catalogue`) is stale, models under ``zoo:``, plan files."""
from __future__ import annotations

import difflib
from pathlib import Path

from verify.arguments import UsageError, check_recipe
from verify.catalogue import cached_rows, current_key
from verify.names import MODEL_NAMES, PIPELINE_NAMES, POLICY_NAMES, TORCHPAR_NAMES, WIDENABLE_NAMES
from verify.sweep.shard import ShardError, parse_shard

MODEL_FORMS = "(or NAME@WIDTH, or FILE.py:BUILDER[@WIDTH] where BUILDER(seed[, WIDTH]) returns a ModelCase or (model, batch_fn))"
"""The tail of ``verify model``'s line for an unknown model."""


def check_policies(specs) -> None:
    """Built-in names (:data:`verify.names.POLICY_NAMES`, :data:`verify.names.PIPELINE_NAMES`) or
    ``FILE.py:function`` naming a Python file that exists (its function is looked up later)."""
    for spec in specs:
        if spec in POLICY_NAMES or spec in PIPELINE_NAMES:
            continue
        if ":" not in spec:
            raise UsageError(f"unknown policy {spec!r}; built-in: {', '.join(sorted(POLICY_NAMES))}, "
                             f"or FILE.py:function for your own")
        path = spec.rpartition(":")[0]
        if not Path(path).is_file() or Path(path).suffix != ".py":
            raise UsageError(f"policy {spec!r}: {path} is not a Python file (give FILE.py:function)")


def known_model_name(name: str) -> bool | None:
    """Whether ``name`` is a built-in model or ``NAME@WIDTH`` of a widenable one; None where only
    the registry can tell (``FILE.py:BUILDER``, ``zoo:TYPE``, a plan ``PATH.json``)."""
    path, sep, attr = name.rpartition(":")
    if (sep and path.endswith(".py") and attr) or name.startswith("zoo:") or name.endswith(".json"):
        return None
    base, _, width = name.partition("@")
    return name in MODEL_NAMES or (base in WIDENABLE_NAMES and width.isdigit() and int(width) > 0)


def check_ops(names) -> None:
    """Each of ``names`` in the catalogue as cached for this very source (the line the registry's
    ``UnknownOpError`` says); nothing is checked while the cache is stale."""
    rows = cached_rows(current_key()) if names else None
    if rows is None:
        return
    known = [r[0] for r in rows]
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else "; run 'python -m verify list' to see them"
            raise UsageError(f"unknown operator {name!r}{hint}")


def check_args(args) -> None:
    """Every check above that applies to ``args`` (raises :class:`~verify.arguments.UsageError`)."""
    own = bool(getattr(args, "module", None))  # a --module file may register models, operators, policies
    if args.command in ("model", "all"):
        check_recipe(args)
    if args.command == "model":
        if not own and known_model_name(args.name) is False:
            raise UsageError(f"unknown model {args.name!r}; known: {', '.join(MODEL_NAMES)} {MODEL_FORMS}")
        if args.policy and not own and args.parallelize is None:
            check_policies(args.policy)
    elif args.command == "op" and not own:
        if args.model is not None and known_model_name(args.model) is False:
            raise UsageError(f"unknown model {args.model!r}; known: {', '.join(MODEL_NAMES)} {MODEL_FORMS}")
        if args.model is None and args.name is not None and args.node is None:
            check_ops([args.name])
    elif args.command == "lint" and not own:
        check_ops(args.names)
    elif args.command == "all":
        if args.shard:
            try:
                parse_shard(args.shard)
            except ShardError as exc:
                raise UsageError(str(exc)) from None
        unknown = sorted(set(args.torchpar or ()) - set(TORCHPAR_NAMES))
        if unknown:
            raise UsageError(f"--torchpar {unknown[0]}: no such case; known: {', '.join(TORCHPAR_NAMES)}")
        if not own:
            check_ops(args.op or ())
            bad = [m for m in args.model or () if known_model_name(m) is False]
            if bad:
                raise UsageError(f"unknown model {bad[0]!r}; known: {', '.join(MODEL_NAMES)}")
