"""The ``plan`` subcommand's arguments (``python -m verify plan PATH``), free of torch like the rest of
:mod:`verify.arguments`; the command itself is :func:`verify.plan.cli.cmd_plan`."""
from __future__ import annotations

import argparse

DEFAULT_TIMEOUT_S = 60.0
"""``python -m verify plan``'s ``--timeout``: a plan's case limit is 8x this (``verify all``'s plan units too)."""


def add_plan_parser(sub) -> None:
    """The ``plan`` subcommand of ``python -m verify`` (``sub``: its subparsers)."""
    p = sub.add_parser("plan", help="verify a saved cluster plan on a reduced model of the same architecture",
                       description="Verify a saved cluster plan on a reduced model of the same architecture and plan structure, against one device.")
    p.add_argument("path", metavar="PATH", help="a plan file written by plan_cluster(...).save(PATH)")
    p.add_argument("--as-planned", action="store_true",
                   help="keep the plan's own parallel degrees (its world size must run here) instead of 2 per axis")
    p.add_argument("--precision", default=None, metavar="RECIPE",
                   help="run under this precision recipe instead of the plan's (e.g. 32-true)")
    p.add_argument("--steps", type=_positive_int, default=3, help="AdamW steps (default 3)")
    p.add_argument("--seed", type=_positive_int, default=0, help="seed of the model and batches (default 0)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
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


