"""``python -m verify``: parsed and checked without torch (:mod:`verify.arguments`, :mod:`verify.argcheck`),
so ``--help``, ``--version``, a bad flag, an unknown policy, model or (cached) operator, a bad recipe value
or ``--shard`` and a cached ``list`` answer at once; every other command imports :mod:`verify.cli`."""
from __future__ import annotations

import sys
from typing import Sequence

from verify.argcheck import check_args
from verify.arguments import UsageError, build_parser
from verify.catalogue import cached_rows, current_key, render


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        check_args(args)
    except UsageError as exc:
        print(f"verify: error: {exc}", file=sys.stderr)
        return 2
    if args.command == "list" and not args.module:  # the catalogue's rows as cached for this very source
        rows = cached_rows(current_key())
        if rows is not None:
            print(render(rows))
            return 0
    from verify.cli import run  # torch, the compiler and the harness: only for a command that runs
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
