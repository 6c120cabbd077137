"""Progress of a verification run: on a terminal, a ``rich`` bar (units and cases done, failures so
far, elapsed, an ETA from the units' recorded times, what runs now); elsewhere (CI logs, pipes) one
plain line per finished unit."""
from __future__ import annotations

import sys
import time
from typing import Sequence, TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


def _clock(seconds: float) -> str:
    m, s = divmod(int(max(seconds, 0) + 0.5), 60)
    return f"{m}:{s:02d}"


class RunProgress:
    """``with RunProgress(n, expected) as p: p.start(label); ...; p.done(label, rows, cached)``;
    ``expected``: each unit's recorded seconds, in run order (the ETA scales what is left by how
    the finished units compared with their records, so a slower machine gets a longer ETA)."""

    def __init__(self, total: int, expected: Sequence[float] | None = None, stream: TextIO | None = None,
                 force_terminal: bool | None = None):
        self.total = total
        self.expected = list(expected) if expected is not None else [1.0] * total
        self.stream = stream or sys.stdout
        tty = self.stream.isatty() if force_terminal is None else force_terminal
        self._bar = None
        if tty:
            console = Console(file=self.stream, force_terminal=True)
            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                 TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=console,
                                 transient=False)
            self._task = None
        self._t0 = time.perf_counter()
        self._item_t0 = self._t0
        self.finished = self.cases = self.failed = 0
        self._spent_expected = 0.0

    def eta(self) -> float:
        """Seconds left: the recorded seconds of the units left, times how this run compares with the record."""
        left = sum(self.expected[self.finished:])
        ran = time.perf_counter() - self._t0
        pace = ran / self._spent_expected if self._spent_expected > 0 else 1.0
        return left * pace

    def status(self) -> str:
        return (f"{self.finished}/{self.total} units, {self.cases} cases, {self.failed} failed, "
                f"ETA {_clock(self.eta())}")

    def __enter__(self) -> "RunProgress":
        if self._bar is not None:
            self._bar.start()
            self._task = self._bar.add_task("starting ranks", total=sum(self.expected) or 1, status=self.status())
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def start(self, label: str) -> None:
        """``label`` is running now."""
        self._item_t0 = time.perf_counter()
        if self._bar is not None:
            self._bar.update(self._task, description=label)

    def done(self, label: str, rows: Sequence, cached: bool = False) -> None:
        """``label`` finished with ``rows`` (one line with its counts and the run's so far)."""
        if self.finished < len(self.expected):
            self._spent_expected += self.expected[self.finished]
        self.finished += 1
        bad = sum(not r.ok for r in rows)
        self.cases += len(rows)
        self.failed += bad
        line = (f"  [{self.finished}/{self.total}] {label:<44} {len(rows):>4} cases  {len(rows) - bad:>4} match  "
                f"{bad:>3} failed  " + ("cached" if cached else f"{time.perf_counter() - self._item_t0:6.2f} s")
                + f"  | {self.failed} failed so far, ETA {_clock(self.eta())}")
        if self._bar is not None:
            self._bar.console.print(line, highlight=False, markup=False)
            self._bar.update(self._task, completed=self._spent_expected, status=self.status())
        else:
            print(line, file=self.stream, flush=True)
