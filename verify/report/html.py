"""``reports/report.html``: one self-contained page (no scripts, no external files).

Top to bottom: the summary; failing rows first, each with its reason and the command that reruns
it, and under a model row its localisation (the first divergent operator or conversion: source line,
partition, layouts, steps, error against bound, the command verifying it alone) with its per-tensor
error/bound profile along the program (an inline sparkline of every compared tensor, forward then
backward, and the worst of them); a rollup per family; and a plot of how close every case came to
failing: one dot per case at its worst error/tolerance ratio (log scale), one strip per family, the
failure line at ratio 1, failures in red at the right edge.
"""
from __future__ import annotations

import html
import math
from collections import OrderedDict
from typing import Sequence

from verify.judge.verdict import MATCH

from verify.judge.row import Row
from verify.localize.tensor_trace import PROFILE_POINTS

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


def _ratio(err, tol) -> float:
    if err is None or tol is None:
        return math.nan
    return err / tol if tol else (0.0 if err == 0 else math.inf)


def _y(r: float, top: float, height: float) -> float:
    """Height of ratio ``r`` in a sparkline (log scale, LOG_MIN at the bottom, above LOG_MAX at the top)."""
    lg = LOG_MAX if not math.isfinite(r) else (LOG_MIN if r <= 0 else min(max(math.log10(r), LOG_MIN), LOG_MAX))
    return top + height - (lg - LOG_MIN) / (LOG_MAX - LOG_MIN) * height


def sparkline(profile: Sequence[Sequence], width: float = 640.0, height: float = 70.0) -> str:
    """An inline SVG of a localisation profile (``[label, F|B, err, tol]`` per compared tensor, in the
    order compared): error/bound per tensor on a log scale, forward values then backward gradients,
    the bound (ratio 1) as a red line, each tensor beyond it a red dot, the first one labelled."""
    n = max(len(profile), 1)
    left, top = 34.0, 8.0
    xs = [left + width * i / max(n - 1, 1) for i in range(len(profile))]
    ratios = [_ratio(p[2], p[3]) for p in profile]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 8:.0f}" height="{top + height + 22:.0f}" '
             f'role="img" aria-label="error over bound per tensor along the program">']
    for k in (int(LOG_MIN), 0, int(LOG_MAX)):
        y = _y(10.0 ** k, top, height)
        parts.append(f'<text x="{left - 4}" y="{y + 3:.1f}" font-size="9" text-anchor="end">1e{k}</text>')
    y1 = _y(1.0, top, height)
    parts.append(f'<line x1="{left}" y1="{y1:.1f}" x2="{left + width}" y2="{y1:.1f}" stroke="{FAIL_COLOR}" stroke-width="1"/>')
    back = next((i for i, p in enumerate(profile) if p[1] == "B"), None)
    if back:
        parts.append(f'<line x1="{xs[back]:.1f}" y1="{top}" x2="{xs[back]:.1f}" y2="{top + height}" stroke="#999" '
                     f'stroke-dasharray="3,3"/><text x="{xs[back] + 3:.1f}" y="{top + height + 18:.1f}" font-size="9">'
                     f'backward</text>')
    parts.append(f'<text x="{left}" y="{top + height + 18:.1f}" font-size="9">forward</text>')
    pts = " ".join(f"{x:.1f},{_y(r, top, height):.1f}" for x, r in zip(xs, ratios) if not math.isnan(r))
    parts.append(f'<polyline points="{pts}" fill="none" stroke="{OK_COLOR}" stroke-width="1"/>')
    first = True
    for x, r, p in zip(xs, ratios, profile):
        if r > 1:
            parts.append(f'<circle cx="{x:.1f}" cy="{_y(r, top, height):.1f}" r="{3.5 if first else 2}" fill="{FAIL_COLOR}"/>')
            if first:
                parts.append(f'<text x="{min(x + 5, left + width - 120):.1f}" y="{top + 9:.1f}" font-size="10" '
                             f'fill="{FAIL_COLOR}">{html.escape(str(p[0]))}</text>')
            first = False
    parts.append("</svg>")
    return "".join(parts)


LOCALIZATION_FIELDS = (("kind", "first divergent"), ("op", "operator"), ("overload", "ATen / registered"),
                       ("tensor", "tensor"), ("direction", "value or gradient"), ("where", "program"),
                       ("source", "source line"), ("partition", "plan's partition"), ("layouts", "layouts"),
                       ("conversion", "conversion"))


def localization(row: Row) -> str:
    """A mismatching model row's localisation: the culprit's fields, error against bound, the command
    verifying it alone, and the per-tensor profile (sparkline, and the worst tensors in a table)."""
    loc = row.localization or {}
    d = loc.get("divergence")
    out = ["<div class='loc'>"]
    if d:
        out.append("<table class='loc'>")
        for key, title in LOCALIZATION_FIELDS:
            if d.get(key):
                value = {"forward": "value (forward)", "backward": "gradient (backward)"}.get(d[key], d[key]) \
                    if key == "direction" else d[key]
                out.append(f"<tr><th>{title}</th>" + _cell(value) + "</tr>")
        bound = f"{d['err']:.3g} / {d['tol']:.3g} ({_ratio(d['err'], d['tol']):.3g}x)"
        out.append("<tr><th>error / bound</th>" + _cell(bound) + "</tr>")
        alone = loc.get("alone")
        how = (f"<code>{html.escape(alone)}</code>" if alone else
               "a conversion exists only inside the whole program: the row's rerun reproduces it"
               if d.get("kind") != "operator" else "-")
        out.append(f"<tr><th>rerun alone</th><td>{how}</td></tr></table>")
    elif loc.get("note"):
        out.append(f"<p>{html.escape(loc['note'])}</p>")
    prof = loc.get("profile") or []
    if prof:
        bad = [p for p in prof if _ratio(p[2], p[3]) > 1]
        thinned = "" if len(prof) < PROFILE_POINTS else f" (thinned to {len(prof)}: the worst of each run of tensors)"
        out.append(f"<p>Error / bound per tensor along the program{thinned}: {sum(p[1] == 'F' for p in prof)} values "
                   f"forward, then {sum(p[1] == 'B' for p in prof)} gradients backward; {len(bad)} beyond the bound.</p>")
        out.append(sparkline(prof))
        worst = sorted((p for p in prof if not math.isnan(_ratio(p[2], p[3]))), key=lambda p: -_ratio(p[2], p[3]))
        shown = list({id(p): p for p in bad[:1] + worst[:5]}.values())  # the first beyond its bound, then the worst
        out.append("<table class='prof'><tr><th>tensor</th><th></th><th>error</th><th>bound</th><th>error / bound</th></tr>")
        for p in shown:
            out.append("<tr>" + _cell(p[0]) + _cell("value" if p[1] == "F" else "gradient") + _cell(f"{p[2]:.3g}")
                       + _cell(f"{p[3]:.3g}") + _cell(f"{_ratio(p[2], p[3]):.3g}") + "</tr>")
        out.append("</table>")
    out.append("</div>")
    return "".join(out)


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
           ".bad{color:" + FAIL_COLOR + ";font-weight:bold}table.loc th,table.prof th{width:140px}"
           "tr.loc>td{background:#fff7f7}</style></head><body>",
           "<h1>nnscaler-verify report</h1>",
           f"<p>World sizes {html.escape(str(cfg.get('world_sizes')))}, dtype {html.escape(str(cfg.get('dtype')))}, "
           f"seeds {html.escape(str(cfg.get('seeds')))}; {s.get('cases', 0)} cases: "
           + ", ".join(f"{v} {html.escape(k)}" for k, v in s.items() if k != "cases")
           + f"; {meta.get('seconds', 0):.1f} s."
           + (f" {sum(r.cached for r in rows)} verdicts reused from the verdict cache (<code>--no-cache</code> "
              "runs them again)." if any(r.cached for r in rows) else "") + "</p>"]
    verdict = (f"<p class='bad'>{len(failed)} failing cases</p>" if failed else
               "<p class='ok'>every case matched</p>")
    out.append(verdict)
    if failed:
        out.append("<h2 id='failures'>Failing cases</h2><table><tr><th>op / model</th><th>W</th><th>partition / "
                   "policy</th><th>seed</th><th>status</th><th>reason (first divergent operator)</th><th>rerun</th></tr>")
        for r in failed:
            out.append("<tr class='fail'>" + _cell(r.op) + _cell(r.world_size or "-") + _cell(r.partition) + _cell(r.seed)
                       + _cell(r.status) + _cell(r.detail) + f"<td><code>{html.escape(r.rerun)}</code></td></tr>")
            if r.localization:
                out.append(f"<tr class='loc'><td></td><td colspan='6'><b>Localisation</b>{localization(r)}</td></tr>")
        out.append("</table>")
    out.append("<h2>How close every case came to failing</h2>" + plot(rows))
    out.append("<h2>Per family</h2><table><tr><th>family</th><th>operators</th><th>cases</th><th>match</th>"
               "<th>failed</th><th>cached</th><th>worst error / tolerance</th></tr>")
    for fam, rs in fams.items():
        ratios = [x for x in (ratio(r) for r in rs) if x is not None]
        worst = f"{max(ratios):.3g}" if ratios else "-"
        bad = sum(not r.ok for r in rs)
        out.append(f"<tr{' class=fail' if bad else ''}>" + _cell(fam) + _cell(len({r.op for r in rs})) + _cell(len(rs))
                   + _cell(sum(r.status == MATCH for r in rs)) + _cell(bad) + _cell(sum(r.cached for r in rs))
                   + _cell(worst) + "</tr>")
    out.append("</table></body></html>")
    return "\n".join(out)
