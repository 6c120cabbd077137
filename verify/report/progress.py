"""Progress of a verification run: a ``rich`` bar on a terminal (n/N, elapsed, ETA, what runs now),
one plain line per finished item elsewhere (CI logs, pipes)."""
from __future__ import annotations

import sys
import time
from typing import Sequence, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class RunProgress:
    """``with RunProgress(total) as p: p.start("model:nanogpt dp W=2"); ...; p.done(label, rows)``."""

    def __init__(self, total: int, stream: TextIO | None = None, force_terminal: bool | None = None):
        self.total = total
        self.stream = stream or sys.stdout
        tty = self.stream.isatty() if force_terminal is None else force_terminal
        self._bar = None
        if tty:
            console = Console(file=self.stream, force_terminal=True)
            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console,
                                 transient=False)
            self._task = None
        self._t0 = time.perf_counter()
        self._item_t0 = self._t0
        self.finished = 0

    def __enter__(self) -> "RunProgress":
        if self._bar is not None:
            self._bar.start()
            self._task = self._bar.add_task("starting ranks", total=self.total)
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def start(self, label: str) -> None:
        """``label`` is running now."""
        self._item_t0 = time.perf_counter()
        if self._bar is not None:
            self._bar.update(self._task, description=label)

    def done(self, label: str, rows: Sequence) -> None:
        """``label`` finished with ``rows`` (one line with its counts)."""
        self.finished += 1
        bad = sum(not r.ok for r in rows)
        line = (f"  [{self.finished}/{self.total}] {label:<34} {len(rows):>4} cases  {len(rows) - bad:>4} match  "
                f"{bad:>3} failed  {time.perf_counter() - self._item_t0:6.2f} s")
        if self._bar is not None:
            self._bar.console.print(line, highlight=False, markup=False)
            self._bar.advance(self._task)
        else:
            print(line, file=self.stream, flush=True)
