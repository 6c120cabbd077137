"""Tables and reports: the terminal table (tabulate), and ``reports/`` as JSON lines (appended case
by case, so an interrupted run keeps what it finished), JSON, Markdown, JUnit XML and HTML."""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import sys
import time
import xml.etree.ElementTree as ET
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Sequence

from tabulate import tabulate

from nnscaler.io import atomic_write

from verify.report import html as html_report
from verify.judge.verdict import MATCH
from verify.config import RunConfig
from verify.judge.row import Row
from verify.names import OVERWRITE

CASES_FILE = "cases.jsonl"
LOCK_FILE = ".lock"  # flock'ed by the one run writing the directory, removed when it ends
DETAIL_WIDTH = 60  # the terminal table's reason column wraps near this many characters (reports keep one line)
REPORT_FILES = (CASES_FILE, "report.json", "report.md", "junit.xml", "report.html")  # what a run writes


def _err(err: float | None, tol: float | None) -> str:
    if err is None:
        return "-"
    return f"{err:.2e} / {tol:.2e}"


def _wrapped(text: str, width: int | None) -> str:
    """``text`` on lines of about ``width`` characters, broken after its clauses (``; ``) only, so no
    name, number or phrase is cut (a longer clause keeps its own line); ``None``: as it is."""
    if not width:
        return text
    lines: list[str] = []
    for clause in text.split("; "):
        if lines and len(lines[-1]) + 2 + len(clause) <= width:
            lines[-1] += "; " + clause
        else:
            if lines:
                lines[-1] += ";"
            lines.append(clause)
    return "\n".join(lines)


def table(rows: Sequence[Row], with_op: bool = False, wrap: int | None = DETAIL_WIDTH) -> str:
    """One line per (world size, partition): errors against tolerances, status, and for a failure the
    first mismatching tensor and the command that reruns the row alone. ``wrap``: the reason's
    width, its text on as many lines as it needs (:func:`_wrapped`) (the terminal's; ``None``: one line, as in report.md)."""
    headers = (["op"] if with_op else []) + ["W", "partition", "seed", "output err / tol", "grad err / tol",
                                             "status", "first mismatch / reason", "rerun"]
    body = [([r.op] if with_op else []) + [r.world_size or "-", r.partition, r.seed, _err(r.out_err, r.out_tol),
                                            _err(r.grad_err, r.grad_tol), r.status,
                                            _wrapped(r.detail, wrap), r.rerun]
            for r in rows]
    return tabulate(body, headers=headers, tablefmt="github")


def summary(rows: Sequence[Row]) -> dict[str, int]:
    out: dict[str, int] = {"cases": len(rows)}
    for r in rows:
        out[r.status] = out.get(r.status, 0) + 1
    return out


def _config_of(cfg: RunConfig, settings: dict | None = None) -> dict:
    """Everything that decides what a row means: resumed rows must come from the same configuration;
    ``settings``: what else the command ran with (``verify model``'s policies, steps and recipe)."""
    return {"world_sizes": list(cfg.world_sizes), "dtype": cfg.dtype, "seeds": list(cfg.seeds),
            "modules": [str(Path(m).resolve()) for m in cfg.modules], "base": cfg.base, "partition": cfg.partition,
            **json.loads(json.dumps(settings or {}))}  # as report.json reads back (lists, not tuples)


def foreign_files(directory: Path) -> list[str]:
    """The files of ``directory`` named as a run's reports (:data:`REPORT_FILES`) that no ``verify``
    run wrote there: a ``report.json`` that is not a verify report (a dict with ``config`` and
    ``cases``) makes every one of them foreign; without one, a ``cases.jsonl`` of valid rows is a
    run's (cut short before its first report), anything else is foreign."""
    present = [n for n in REPORT_FILES if (directory / n).exists()]
    if not present:
        return []
    try:
        meta = json.loads((directory / "report.json").read_text())
    except FileNotFoundError:
        meta = None
    except (OSError, ValueError):
        return present
    if meta is not None:
        ours = isinstance(meta, dict) and isinstance(meta.get("config"), dict) and isinstance(meta.get("cases"), list)
        return [] if ours else present
    cases = directory / CASES_FILE
    valid = cases.exists() and cases.is_file() and _valid_lines(cases)[1] == cases.read_bytes()
    return [n for n in present if n != CASES_FILE or not valid]


class ReportError(RuntimeError):
    """The reports directory cannot be used (busy, unwritable, full, another configuration): one line."""


def _oserror(what: str, exc: OSError) -> ReportError:
    return ReportError(f"{what}: {exc.strerror or exc}")


def _valid_lines(path: Path) -> tuple[list[Row], bytes]:
    """Rows of whole, valid lines, and those lines' bytes (a line cut short by an interruption, or
    garbage, is left out: the next row then starts on a line of its own)."""
    rows, keep = [], []
    for line in path.read_bytes().split(b"\n"):
        try:
            rows.append(Row(**json.loads(line)))
            keep.append(line + b"\n")
        except (json.JSONDecodeError, TypeError, UnicodeDecodeError, ValueError):
            continue
    return rows, b"".join(keep)


def load_rows(directory: Path) -> list[Row]:
    """Rows already written to ``directory`` (for resuming an interrupted run)."""
    path = Path(directory) / CASES_FILE
    return _valid_lines(path)[0] if path.exists() else []


class ReportWriter:
    """Writes ``reports/``: each row is appended to ``cases.jsonl`` the moment it is known (one
    ``write`` of a whole line on an append-only descriptor); ``report.json``, ``report.md`` and
    ``junit.xml`` are rewritten atomically from all rows by :meth:`flush`.

    One writer per directory: a second run into a directory in use is refused (``ReportError``).
    ``resume`` True keeps the valid rows of a run with the same configuration (another configuration
    is refused), each case once, and drops failed-to-run rows (error, timeout, crash) so they run
    again; :data:`OVERWRITE` replaces whatever is there. Without either, rows already there are
    replaced only when a finished run of the same ``command`` at the same configuration wrote them
    (one line says so, on stderr); rows of an unfinished run, of another command or configuration
    are refused, in one line naming the way out. Files named as reports that ``verify`` did not write
    (:func:`foreign_files`) are never replaced, whatever the options. ``report.json`` records
    ``command`` and whether the run finished (``complete``: it closed with no exception on its way).
    """

    RERUN = ("error", "timeout", "crash")

    def __init__(self, directory: str | os.PathLike, cfg: RunConfig, resume: bool | str = False,
                 command: str = "all", settings: dict | None = None):
        self.dir = Path(directory)
        self.cfg = cfg
        self.command = command
        self.settings = settings or {}  # more of what the rows mean (:func:`_config_of`)
        self.complete = False
        self.seconds = 0.0
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _oserror(f"cannot create the reports directory {self.dir}", exc) from None
        if not self.dir.is_dir():
            raise ReportError(f"reports directory {self.dir} is not a directory")
        self._lock = self._acquire()
        self._flushed = 0.0
        self.sweep: dict = {}  # verify all: the selection, shard and finished units (verify/sweep/shard.py)
        try:
            foreign = foreign_files(self.dir)
            if foreign:  # whatever the options: verify replaces only what verify wrote
                raise ReportError(f"{self.dir} holds {', '.join(foreign)} that verify did not write; move "
                                  f"{'it' if len(foreign) == 1 else 'them'} away or pass another --reports")
            if resume is not True and resume != OVERWRITE:
                self._check_replace()
            self.rows: list[Row] = self._resume() if resume is True else []
        except (ReportError, OSError) as exc:
            self._release()
            raise exc if isinstance(exc, ReportError) else _oserror(f"cannot read {self.dir}", exc) from None
        try:
            kept = b"".join((json.dumps(r.to_json()) + "\n").encode() for r in self.rows)
            atomic_write(self.dir / CASES_FILE, kept)
            self._fd = os.open(self.dir / CASES_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self.flush()
        except OSError as exc:
            self._release()
            raise _oserror(f"cannot write reports into {self.dir}", exc) from None

    def _acquire(self):
        """The directory's lock file, created and ``flock``'ed (holding this pid); a lock file that
        its holder removed between our open and our lock is opened again."""
        path = self.dir / LOCK_FILE
        while True:
            try:
                fh = open(path, "a+")
            except OSError as exc:
                raise _oserror(f"cannot write reports into {self.dir}", exc) from None
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.seek(0)
                holder = fh.read().strip() or "?"
                fh.close()
                raise ReportError(f"reports directory {self.dir} is in use by another run (pid {holder}); wait "
                                  f"for it to finish or pass another --reports") from None
            try:
                same = os.fstat(fh.fileno()).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            fh.close()
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        return fh

    def _release(self) -> None:
        """Remove the lock file, then let go of the lock (a run never leaves it behind)."""
        try:
            (self.dir / LOCK_FILE).unlink()
        except OSError:
            pass
        self._lock.close()

    def _check_replace(self) -> None:
        """Rows already in the directory: replaced (and said) when a finished run of this command at
        this configuration wrote them, else refused."""
        before = load_rows(self.dir)
        if not before:
            return
        try:
            meta = json.loads((self.dir / "report.json").read_text())
            meta = meta if isinstance(meta, dict) else {}
        except (OSError, ValueError):
            meta = {}
        command = meta.get("command", "all")  # reports written before the field: by `verify all`
        finished = meta.get("complete", "config" in meta)  # ... and closed, when report.json is whole
        now = _config_of(self.cfg, self.settings)
        config = meta.get("config") if isinstance(meta.get("config"), dict) else {}
        diff = [k for k in now if config.get(k) != now[k]]
        replace = "pass --overwrite to replace it, or another --reports"
        way = "pass --resume to continue it, --overwrite to replace it, or another --reports" \
            if self.command == "all" else replace  # only `verify all` resumes
        held = f"{self.dir} holds {len(before)} case{'' if len(before) == 1 else 's'} of "
        if command != self.command:
            raise ReportError(held + f"a `python -m verify {command}` run; {way}")
        if not finished:
            raise ReportError(held + f"an unfinished run; {way}")
        if not meta:
            raise ReportError(held + f"a run whose report.json is missing or damaged; {way}")
        if diff:
            settings = ", ".join(f"{k} {config.get(k)} there, {now[k]} now" for k in diff)
            raise ReportError(held + f"a run with other settings ({settings}); {replace}")
        print(f"verify: replacing the finished `python -m verify {command}` run in {self.dir} ({len(before)} cases, "
              f"{meta.get('finished', 'time unknown')})", file=sys.stderr, flush=True)

    def _resume(self) -> list[Row]:
        meta = self.dir / "report.json"
        if meta.exists():
            try:
                before = json.loads(meta.read_text()).get("config", {})
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                before = None
            now = _config_of(self.cfg, self.settings)
            if before is None:
                raise ReportError(f"--resume: {meta} is damaged; run without --resume to start over")
            diff = [k for k in now if before.get(k) != now[k]]
            if diff:
                raise ReportError(f"--resume: {self.dir} holds a run with other settings ("
                                  + ", ".join(f"{k} {before.get(k)} there, {now[k]} now" for k in diff)
                                  + "); resume with the same options or pass another --reports")
            try:
                self.sweep = dict(json.loads(meta.read_text()).get("sweep") or {})
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, TypeError, ValueError):
                self.sweep = {}
        rows = {}
        for r in load_rows(self.dir):
            if r.status in self.RERUN:
                rows.pop(r.key, None)
            else:
                rows[r.key] = r  # each case once, the latest verdict
        return list(rows.values())

    def done(self) -> set[tuple]:
        return {r.key for r in self.rows}

    def add(self, row: Row) -> None:
        data = (json.dumps(row.to_json()) + "\n").encode()
        try:
            written = os.write(self._fd, data)
            if written != len(data):
                raise OSError(28, f"only {written} of {len(data)} bytes written")
        except OSError as exc:
            raise _oserror(f"writing {self.dir / CASES_FILE} failed", exc) from None
        self.rows.append(row)

    FLUSH_EVERY_S = 20.0  # reports rewritten at most this often while running (cases.jsonl: every row)

    def flush_now_and_then(self) -> None:
        """:meth:`flush` if the reports were last written :data:`FLUSH_EVERY_S` ago: rewriting every
        report after every unit costs time quadratic in the rows; ``cases.jsonl`` keeps each row as it comes."""
        if time.monotonic() - self._flushed >= self.FLUSH_EVERY_S:
            self.flush()

    def flush(self) -> None:
        self._flushed = time.monotonic()
        meta = {"config": _config_of(self.cfg, self.settings), "command": self.command, "complete": self.complete,
                "summary": summary(self.rows), "seconds": round(self.seconds, 2), "host": socket.gethostname(),
                "finished": _now()}
        if self.sweep:
            meta["sweep"] = self.sweep
        write_reports(self.dir, self.rows, meta)

    def close(self) -> None:
        """The last flush; the run is ``complete`` unless an exception (an interruption, ranks that
        could not start) is on its way through the caller's ``finally``."""
        self.complete = sys.exc_info()[0] is None
        try:
            self.flush()
        finally:
            os.close(self._fd)
            self._release()


def write_reports(directory: Path, rows: Sequence[Row], meta: dict) -> None:
    """``report.json`` (``meta`` and every row), ``report.md``, ``junit.xml`` and ``report.html``, atomically."""
    try:
        atomic_write(directory / "report.json", json.dumps(dict(meta, cases=[r.to_json() for r in rows]), indent=1))
        atomic_write(directory / "report.md", markdown(rows, _by_op(rows), meta))
        atomic_write(directory / "junit.xml", junit(rows))
        atomic_write(directory / "report.html", html_report.render(rows, meta))
    except OSError as exc:
        raise _oserror(f"writing reports into {directory} failed", exc) from None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _by_op(rows: Iterable[Row]) -> "OrderedDict[str, list[Row]]":
    ops: OrderedDict[str, list[Row]] = OrderedDict()
    for r in rows:
        ops.setdefault(r.op, []).append(r)
    return ops


def markdown(rows: Sequence[Row], ops: "OrderedDict[str, list[Row]]", meta: dict) -> str:
    s = meta["summary"]
    cfg = meta["config"]
    failed = [r for r in rows if not r.ok]
    models = sum(1 for name in ops if name.startswith("model:"))
    operators = len(ops) - models
    what = [f"{n} {word}{'' if n == 1 else 's'}" for n, word in ((operators, "operator"), (models, "model")) if n]
    title = "Model" if operators == 0 else "Operator" if models == 0 else "Operator and model"
    cached = sum(r.cached for r in rows)
    lines = [f"# {title} verification report", "",
             f"World sizes {cfg['world_sizes']}, dtype {cfg['dtype']}, seeds {cfg['seeds']}; "
             f"{', '.join(what) or 'nothing'}, {s['cases']} cases: "
             + ", ".join(f"{v} {k}" for k, v in s.items() if k != "cases")
             + f"; {meta['seconds']:.1f} s." + (f" {cached} of the cases are verdicts reused from the verdict cache "
                                                 "(marked cached below; `--no-cache` runs them again)." if cached else "")
             + _sweep_line(meta), "",
             "Each operator case runs the operator on real ranks under one partition and compares every output and "
             "the gradient of every floating input (random cotangent per output) against float64; each model case "
             "trains the model under a plan against one device (loss, every gradient, every update, checkpoint "
             "resumes); within the tolerance policy of `verify/judge/compare.py`.", ""]
    if failed:
        lines += ["## Failures", "", table(failed, with_op=True, wrap=None), ""]
    lines += ["## Operators", ""]
    body = [[name, rs[0].family, f"`{rs[0].annotation}`", len(rs), sum(r.ok for r in rs), len(rs) - sum(r.ok for r in rs),
             sum(r.cached for r in rs)] for name, rs in ops.items()]
    lines += [tabulate(body, headers=["op", "family", "annotation", "cases", "match", "failed", "cached"],
                       tablefmt="github"), ""]
    return "\n".join(lines)


def _sweep_line(meta: dict) -> str:
    sw = meta.get("sweep")
    if not sw:
        return ""
    what = "the whole matrix (--full)" if sw.get("mode") == "full" else "the default sample (--full runs the whole matrix)"
    part = f", shard {sw['shard']}/{sw['shards']}" if sw.get("shards", 1) > 1 else ""
    merged = f", merged from {sw['merged']} shards" if sw.get("merged") else ""
    return f" Sweep: {what}{part}{merged}, {len(sw.get('units', []))} units."


def junit(rows: Sequence[Row]) -> str:
    suite = ET.Element("testsuite", name="verify", tests=str(len(rows)), timestamp=_now(),
                       hostname=socket.gethostname(),
                       failures=str(sum(r.status == "MISMATCH" for r in rows)),
                       errors=str(sum(r.status not in (MATCH, "MISMATCH") for r in rows)),
                       time=f"{sum(r.seconds for r in rows):.3f}")
    for r in rows:
        name = (f"W{r.world_size}[{r.partition}] {r.dtype} seed{r.seed}" if r.world_size else
                f"sampling {r.dtype} seed{r.seed}")  # a row for an op whose sample could not be made
        case = ET.SubElement(suite, "testcase", classname=f"verify.{r.op}", name=name, time=f"{r.seconds:.4f}")
        if r.cached:  # the verdict of an earlier run, reused (verify/sweep/cache.py)
            ET.SubElement(ET.SubElement(case, "properties"), "property", name="cached", value="true")
        if not r.ok:
            tag = "failure" if r.status == "MISMATCH" else "error"
            el = ET.SubElement(case, tag, message=f"{r.status}: {r.detail}", type=r.status)
            el.text = f"rerun: {r.rerun}\n{r.traceback}"
    ET.indent(suite)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True)
