"""What a gang rank says on standard error, kept where it survives the rank: each rank's fd 2 goes to a
file of the gang's, which the harness echoes to its own standard error as it comes and reads back when a
rank dies. A rank aborted by a C++ error (gloo's "Received data size doesn't match expected size. Is there
a distributed collective mismatch in your code?") leaves its reason nowhere else, so the row says it, with
the module the rank was running (a breadcrumb a case writes: :class:`Breadcrumb`).

    logs = RankLogs(4)                  # the harness, per gang start
    logs.mark(r)                        # a job starts on rank r
    logs.echo()                         # while it waits: new output to the harness's stderr
    logs.last_words(r)                  # after rank r died: its reason and where it was
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile

CRUMB_BYTES = 512  # a breadcrumb is at most this long
# lines of a dying rank worth a row, most telling first: a C++ exception's message, then Python's last error line
_TELLING = (re.compile(r"what\(\):\s*(.*)"), re.compile(r"^(\w+(?:Error|Exception)\b.*)$"),
            re.compile(r"^(terminate called .*)$"))
_GLOO_PREFIX = re.compile(r"^\[enforce fail at [^\]]*\]\s*")


class RankLogs:
    """One file of standard error and one breadcrumb per rank, in a folder of this gang's own."""

    def __init__(self, size: int):
        self.dir = tempfile.mkdtemp(prefix="verify-ranks-")
        self._echoed = [0] * size
        self._marks = [0] * size
        for r in range(size):  # the files exist before the ranks start: offsets are never ahead of them
            open(self.stderr_path(r), "wb").close()
            open(self.crumb_path(r), "wb").close()

    def stderr_path(self, rank: int) -> str:
        return os.path.join(self.dir, f"rank{rank}.stderr")

    def crumb_path(self, rank: int) -> str:
        return os.path.join(self.dir, f"rank{rank}.where")

    def _read(self, rank: int, start: int) -> bytes:
        try:
            with open(self.stderr_path(rank), "rb") as f:
                f.seek(start)
                return f.read()
        except OSError:
            return b""

    def echo(self, stream=None) -> None:
        """Everything the ranks wrote since the last echo, to ``stream`` (the harness's stderr)."""
        stream = stream or sys.stderr
        for r in range(len(self._echoed)):
            new = self._read(r, self._echoed[r])
            if new:
                self._echoed[r] += len(new)
                stream.write(new.decode(errors="replace"))
        stream.flush()

    def mark(self, rank: int) -> None:
        """A job starts on ``rank``: what it says from here on is the job's."""
        self.echo()
        self._marks[rank] = self._echoed[rank]
        try:
            with open(self.crumb_path(rank), "wb"):
                pass
        except OSError:
            pass

    def where(self, rank: int) -> str:
        """The last breadcrumb ``rank`` wrote during its job ('' if none)."""
        try:
            with open(self.crumb_path(rank), "rb") as f:
                return f.read(CRUMB_BYTES).rstrip(b"\0 \n").decode(errors="replace")
        except OSError:
            return ""

    def last_words(self, rank: int) -> str:
        """Why ``rank`` died, in one clause for its row: the most telling line it wrote during its job and the
        module it was in; '' when it said nothing telling and left no breadcrumb."""
        text = self._read(rank, self._marks[rank]).decode(errors="replace")
        said = telling_line(text)
        where = self.where(rank)
        parts = ([said] if said else []) + ([f"while in {where}"] if where else [])
        return "; ".join(parts)

    def close(self) -> None:
        self.echo()
        shutil.rmtree(self.dir, ignore_errors=True)


def telling_line(text: str) -> str:
    """The line of a dying process's stderr that says why: a C++ exception's ``what()`` (gloo's enforce
    prefix, a build path, dropped), else the last Python error line, else ''."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for pattern in _TELLING:
        found = [m.group(1) for m in map(pattern.search, lines) if m]
        if found:
            return _GLOO_PREFIX.sub("", found[-1]).strip()
    return ""


def redirect_stderr(path: str) -> None:
    """In a rank: its fd 2 (Python's and C++'s standard error alike) appends to ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    os.close(fd)


class Breadcrumb:
    """In a rank: where it is, overwritten in place (one small write per call), for the harness to read if
    the rank dies there."""

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def set(self, text: str) -> None:
        data = text.encode()[:CRUMB_BYTES]
        os.pwrite(self._fd, data.ljust(CRUMB_BYTES, b"\0"), 0)
