"""Tables and reports: the terminal table (tabulate), and ``reports/`` as JSON lines (appended case
by case, so an interrupted run keeps what it finished), JSON, Markdown, JUnit XML and HTML."""
from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Sequence

from tabulate import tabulate

from . import html_report
from .cases import MATCH, Row, RunConfig

CASES_FILE = "cases.jsonl"


def _err(err: float | None, tol: float | None) -> str:
    if err is None:
        return "-"
    return f"{err:.2e} / {tol:.2e}"


def table(rows: Sequence[Row], with_op: bool = False) -> str:
    """One line per (world size, partition): errors against tolerances, status, and for a failure the
    first mismatching tensor and the command that reruns the row alone."""
    headers = (["op"] if with_op else []) + ["W", "partition", "seed", "output err / tol", "grad err / tol",
                                             "status", "first mismatch / reason", "rerun"]
    body = [([r.op] if with_op else []) + [r.world_size, r.partition, r.seed, _err(r.out_err, r.out_tol),
                                            _err(r.grad_err, r.grad_tol), r.status, r.detail, r.rerun]
            for r in rows]
    return tabulate(body, headers=headers, tablefmt="github")


def summary(rows: Sequence[Row]) -> dict[str, int]:
    out: dict[str, int] = {"cases": len(rows)}
    for r in rows:
        out[r.status] = out.get(r.status, 0) + 1
    return out


def load_rows(directory: Path) -> list[Row]:
    """Rows already written to ``directory`` (for resuming an interrupted run)."""
    path = Path(directory) / CASES_FILE
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(Row(**json.loads(line)))
        except (json.JSONDecodeError, TypeError):
            continue  # a line cut short by an interruption
    return rows


class ReportWriter:
    """Writes ``reports/``: each row is appended to ``cases.jsonl`` the moment it is known;
    ``report.json``, ``report.md`` and ``junit.xml`` are rewritten from all rows by :meth:`flush`."""

    def __init__(self, directory: str | os.PathLike, cfg: RunConfig, resume: bool = False):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cfg = cfg
        self.rows: list[Row] = load_rows(self.dir) if resume else []
        mode = "a" if resume else "w"
        self._fh = open(self.dir / CASES_FILE, mode, encoding="utf-8")
        self.seconds = 0.0

    def done(self) -> set[tuple]:
        return {r.key for r in self.rows}

    def add(self, row: Row) -> None:
        self.rows.append(row)
        self._fh.write(json.dumps(row.to_json()) + "\n")
        self._fh.flush()

    def flush(self) -> None:
        ops = _by_op(self.rows)
        meta = {"config": {"world_sizes": list(self.cfg.world_sizes), "dtype": self.cfg.dtype,
                           "seeds": list(self.cfg.seeds), "modules": list(self.cfg.modules)},
                "summary": summary(self.rows), "seconds": round(self.seconds, 2)}
        _atomic(self.dir / "report.json", json.dumps(dict(meta, cases=[r.to_json() for r in self.rows]), indent=1))
        _atomic(self.dir / "report.md", markdown(self.rows, ops, meta))
        _atomic(self.dir / "junit.xml", junit(self.rows))
        _atomic(self.dir / "report.html", html_report.render(self.rows, meta))

    def close(self) -> None:
        self.flush()
        self._fh.close()


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".partial")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _by_op(rows: Iterable[Row]) -> "OrderedDict[str, list[Row]]":
    ops: OrderedDict[str, list[Row]] = OrderedDict()
    for r in rows:
        ops.setdefault(r.op, []).append(r)
    return ops


def markdown(rows: Sequence[Row], ops: "OrderedDict[str, list[Row]]", meta: dict) -> str:
    s = meta["summary"]
    cfg = meta["config"]
    failed = [r for r in rows if not r.ok]
    lines = ["# Operator verification report", "",
             f"World sizes {cfg['world_sizes']}, dtype {cfg['dtype']}, seeds {cfg['seeds']}; "
             f"{len(ops)} operators, {s['cases']} cases: "
             + ", ".join(f"{v} {k}" for k, v in s.items() if k != "cases")
             + f"; {meta['seconds']:.1f} s.", "",
             "Each case runs the operator on real ranks under one partition and compares every output and "
             "the gradient of every floating input (random cotangent per output) against float64, within the "
             "tolerance policy of `verify/compare.py`.", ""]
    if failed:
        lines += ["## Failures", "", table(failed, with_op=True), ""]
    lines += ["## Operators", ""]
    body = [[name, rs[0].family, f"`{rs[0].annotation}`", len(rs), sum(r.ok for r in rs), len(rs) - sum(r.ok for r in rs)]
            for name, rs in ops.items()]
    lines += [tabulate(body, headers=["op", "family", "annotation", "cases", "match", "failed"], tablefmt="github"), ""]
    return "\n".join(lines)


def junit(rows: Sequence[Row]) -> str:
    suite = ET.Element("testsuite", name="verify", tests=str(len(rows)),
                       failures=str(sum(r.status == "MISMATCH" for r in rows)),
                       errors=str(sum(r.status not in (MATCH, "MISMATCH") for r in rows)),
                       time=f"{sum(r.seconds for r in rows):.3f}")
    for r in rows:
        name = (f"W{r.world_size}[{r.partition}] {r.dtype} seed{r.seed}" if r.world_size else
                f"sampling {r.dtype} seed{r.seed}")  # a row for an op whose sample could not be made
        case = ET.SubElement(suite, "testcase", classname=f"verify.{r.op}", name=name, time=f"{r.seconds:.4f}")
        if not r.ok:
            tag = "failure" if r.status == "MISMATCH" else "error"
            el = ET.SubElement(case, tag, message=f"{r.status}: {r.detail}", type=r.status)
            el.text = f"rerun: {r.rerun}\n{r.traceback}"
    ET.indent(suite)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True)
