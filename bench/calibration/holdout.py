"""Leave-one-source-out validation of the cluster cost model against ``nnscaler/cluster/published_runs.csv``.

The fitted constants are chosen on a grid: every grid point's log error ``log(estimate / published)`` on every
row is computed once (:func:`error_table`), so a fold's fit (the point with the smallest mean, then worst,
then median absolute log error on the rows of the other sources) costs a lookup. :func:`holdout` then reads, for each
source, its rows' errors under the constants fitted without it; :func:`series` groups rows that share model,
device, GPU count and sequence (an ablation: one or more knobs varied at fixed model and scale) and gives the
Spearman rank correlation of held-out estimate vs published step time inside each.

Pure functions on plain tables (``{row name: {grid point: log error}}``), so a synthetic table checks them
(``tests/compiler/test_holdout.py``).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


def score(errs: list[float]) -> tuple[float, float, float]:
    """What a fit minimises: the mean absolute log error, then the worst, then the median. (The worst first was
    tried: one badly modelled row then sets every constant, and constants it does not feel fall to grid order.)"""
    a = [abs(e) for e in errs]
    return (statistics.fmean(a), max(a), statistics.median(a)) if a else (0.0, 0.0, 0.0)


def best_point(table: dict[str, dict], names: list[str]):
    """The grid point with the smallest :func:`score` over the rows ``names`` (first of ties in grid order)."""
    points = list(next(iter(table.values())))
    return min(points, key=lambda g: score([table[n][g] for n in names]))


@dataclass
class Fold:
    """One held-out source: the point fitted on the others and its rows' held-out log errors."""

    source: str
    point: object
    errors: dict[str, float]


def holdout(table: dict[str, dict], sources: dict[str, str]) -> list[Fold]:
    """For each source (in first-seen order), fit on the rows of every other source and read its own rows."""
    folds = []
    for src in dict.fromkeys(sources.values()):
        train = [n for n in table if sources[n] != src]
        test = [n for n in table if sources[n] == src]
        g = best_point(table, train) if train else next(iter(table[test[0]]))
        folds.append(Fold(src, g, {n: table[n][g] for n in test}))
    return folds


def rel(log_err: float) -> float:
    """Relative step-time error (estimate / published - 1) of a log error."""
    return math.exp(log_err) - 1


def ranks(xs: list[float]) -> list[float]:
    """Ranks from 1, ties sharing their mean rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (Pearson on ranks); ``nan`` when either side has one distinct value."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return cov / math.sqrt(va * vb) if va and vb else float("nan")


def series(keys: dict[str, tuple]) -> dict[tuple, list[str]]:
    """Rows grouped by key (model, device, GPUs, seq), groups of two or more only."""
    groups: dict[tuple, list[str]] = {}
    for n, k in keys.items():
        groups.setdefault(k, []).append(n)
    return {k: v for k, v in groups.items() if len(v) > 1}
