"""``reports/report.html``: one self-contained page (no scripts, no external files).

Top to bottom: the summary; failing rows first, each with its reason (for a model, the first
divergent operator) and the command that reruns it; a rollup per family; and a plot of how close
every case came to failing: one dot per case at its worst error/tolerance ratio (log scale), one
strip per family, the failure line at ratio 1, failures in red at the right edge.
"""
from __future__ import annotations

import html
import math
from collections import OrderedDict
from typing import Sequence

from verify.judge.verdict import MATCH

from verify.cases.config import Row

FAIL_COLOR = "#d62728"
OK_COLOR = "#1f77b4"
LOG_MIN, LOG_MAX = -8.0, 2.0  # ratios below 1e-8 sit at the left edge; failures at the right


def ratio(row: Row) -> float | None:
    """The case's worst error/tolerance ratio (``None`` when no tensor was compared)."""
    vals = [e / t if t else (0.0 if e == 0 else math.inf) for e, t in ((row.out_err, row.out_tol),
                                                                       (row.grad_err, row.grad_tol))
            if e is not None and t is not None]
    return max(vals) if vals else None


def _x(r: float | None, ok: bool, left: float, width: float) -> float:
    if not ok or r is None or not math.isfinite(r):
        return left + width
    lg = LOG_MIN if r <= 0 else min(max(math.log10(r), LOG_MIN), LOG_MAX)
    return left + (lg - LOG_MIN) / (LOG_MAX - LOG_MIN) * width


def plot(rows: Sequence[Row]) -> str:
    """An inline SVG: per family, a dot per case at its error/tolerance ratio."""
    families = list(OrderedDict.fromkeys(r.family for r in rows))
    left, width, strip, top = 140.0, 640.0, 22.0, 24.0
    height = top + strip * max(len(families), 1) + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 40:.0f}" height="{height:.0f}" '
             f'role="img" aria-label="error over tolerance per family">']
    for k in range(int(LOG_MIN), int(LOG_MAX) + 1):
        x = _x(10.0 ** k, True, left, width)
        parts.append(f'<line x1="{x:.1f}" y1="{top - 6}" x2="{x:.1f}" y2="{height - 24}" stroke="#ddd"/>'
                     f'<text x="{x:.1f}" y="{height - 8}" font-size="10" text-anchor="middle">1e{k}</text>')
    x1 = _x(1.0, True, left, width)
    parts.append(f'<line x1="{x1:.1f}" y1="{top - 10}" x2="{x1:.1f}" y2="{height - 24}" stroke="{FAIL_COLOR}" '
                 f'stroke-width="2"/><text x="{x1 + 4:.1f}" y="{top - 12}" font-size="10" fill="{FAIL_COLOR}">'
                 f'tolerance</text>')
    for i, fam in enumerate(families):
        y = top + strip * i + strip / 2
        parts.append(f'<text x="{left - 8}" y="{y + 4:.1f}" font-size="11" text-anchor="end">{html.escape(fam)}</text>')
        for n, r in enumerate(r for r in rows if r.family == fam):
            jitter = ((n * 7919) % 11 - 5) * 1.2
            color = OK_COLOR if r.ok else FAIL_COLOR
            radius = 2.5 if r.ok else 5
            parts.append(f'<circle cx="{_x(ratio(r), r.ok, left, width):.1f}" cy="{y + jitter:.1f}" r="{radius}" '
                         f'fill="{color}" fill-opacity="{0.45 if r.ok else 0.95}"/>')
    parts.append("</svg>")
    return "".join(parts)


def _cell(text) -> str:
    return f"<td>{html.escape(str(text))}</td>"


def render(rows: Sequence[Row], meta: dict) -> str:
    """The whole page for ``rows`` (``meta``: ``config``, ``summary``, ``seconds`` as in report.json)."""
    s, cfg = meta["summary"], meta["config"]
    failed = [r for r in rows if not r.ok]
    fams: OrderedDict[str, list[Row]] = OrderedDict()
    for r in rows:
        fams.setdefault(r.family, []).append(r)
    out = ["<!doctype html><html><head><meta charset='utf-8'><title>nnscaler-verify report</title><style>",
           "body{font-family:sans-serif;margin:24px;color:#222}table{border-collapse:collapse;margin:8px 0 20px}"
           "td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left;vertical-align:top}"
           "th{background:#f3f3f3}tr.fail td{background:#fde8e8}code{font-size:12px}.ok{color:#2a7a2a}"
           ".bad{color:" + FAIL_COLOR + ";font-weight:bold}</style></head><body>",
           "<h1>nnscaler-verify report</h1>",
           f"<p>World sizes {html.escape(str(cfg.get('world_sizes')))}, dtype {html.escape(str(cfg.get('dtype')))}, "
           f"seeds {html.escape(str(cfg.get('seeds')))}; {s.get('cases', 0)} cases: "
           + ", ".join(f"{v} {html.escape(k)}" for k, v in s.items() if k != "cases")
           + f"; {meta.get('seconds', 0):.1f} s.</p>"]
    verdict = (f"<p class='bad'>{len(failed)} failing cases</p>" if failed else
               "<p class='ok'>every case matched</p>")
    out.append(verdict)
    if failed:
        out.append("<h2 id='failures'>Failing cases</h2><table><tr><th>op / model</th><th>W</th><th>partition / "
                   "policy</th><th>seed</th><th>status</th><th>reason (first divergent operator)</th><th>rerun</th></tr>")
        for r in failed:
            out.append("<tr class='fail'>" + _cell(r.op) + _cell(r.world_size or "-") + _cell(r.partition) + _cell(r.seed)
                       + _cell(r.status) + _cell(r.detail) + f"<td><code>{html.escape(r.rerun)}</code></td></tr>")
        out.append("</table>")
    out.append("<h2>How close every case came to failing</h2>" + plot(rows))
    out.append("<h2>Per family</h2><table><tr><th>family</th><th>operators</th><th>cases</th><th>match</th>"
               "<th>failed</th><th>worst error / tolerance</th></tr>")
    for fam, rs in fams.items():
        ratios = [x for x in (ratio(r) for r in rs) if x is not None]
        worst = f"{max(ratios):.3g}" if ratios else "-"
        bad = sum(not r.ok for r in rs)
        out.append(f"<tr{' class=fail' if bad else ''}>" + _cell(fam) + _cell(len({r.op for r in rs})) + _cell(len(rs))
                   + _cell(sum(r.status == MATCH for r in rs)) + _cell(bad) + _cell(worst) + "</tr>")
    out.append("</table></body></html>")
    return "\n".join(out)
