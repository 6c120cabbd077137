"""Leave-one-source-out validation (bench/calibration/holdout.py) on tables whose answers are known by hand."""
from __future__ import annotations

import math

import pytest

from bench.calibration import holdout

# two constant sets "a" and "b"; rows from sources S and T. On S, "a" is exact and "b" 20% off; on T the reverse.
TABLE = {
    "s1": {"a": 0.0, "b": math.log(1.2)},
    "s2": {"a": 0.0, "b": math.log(1.2)},
    "t1": {"a": math.log(0.7), "b": 0.0},
}
SOURCES = {"s1": "S", "s2": "S", "t1": "T"}


def test_each_fold_is_fitted_on_the_other_sources_only():
    folds = {f.source: f for f in holdout.holdout(TABLE, SOURCES)}
    # holding S out, the fit sees only t1, where "b" is exact: S's rows come out 20% slow, not exact
    assert folds["S"].point == "b" and folds["S"].errors == pytest.approx({"s1": math.log(1.2), "s2": math.log(1.2)})
    # holding T out, the fit sees s1, s2 ("a" exact): t1 is read under "a", 30% fast
    assert folds["T"].point == "a" and holdout.rel(folds["T"].errors["t1"]) == pytest.approx(-0.3)
    # fitted on every row the mean |log error| decides: "a" (0.119) beats "b" (0.122), though its worst is larger
    assert holdout.best_point(TABLE, list(TABLE)) == "a"


def test_the_fit_minimises_the_mean_then_the_worst_then_the_median():
    assert holdout.score([0.1, -0.3, 0.2]) == pytest.approx((0.2, 0.3, 0.2))
    table = {"x": {"p": 0.1, "q": 0.0}, "y": {"p": 0.1, "q": 0.3}}
    assert holdout.best_point(table, list(table)) == "p"  # both mean 0.15: worst 0.1 < 0.3
    table = {"x": {"p": 0.0, "q": 0.1}, "y": {"p": 0.3, "q": 0.2}, "z": {"p": 0.3, "q": 0.3}}
    assert holdout.best_point(table, list(table)) == "q"  # both mean 0.2, both worst 0.3: median 0.2 < 0.3


def test_spearman_and_series():
    assert holdout.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert holdout.spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # one swapped pair of four: 1 - 6 * 2 / (4 * 15) = 0.8
    assert holdout.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert holdout.ranks([5, 1, 5]) == [2.5, 1, 2.5]
    assert math.isnan(holdout.spearman([1, 1], [1, 2]))
    groups = holdout.series({"a": ("m", 8), "b": ("m", 8), "c": ("m", 16)})
    assert groups == {("m", 8): ["a", "b"]}
