"""Progress: a rich bar with n/N, elapsed and ETA on a terminal; one plain line per item elsewhere."""
from __future__ import annotations

import io

from verify.judge.verdict import MATCH, MISMATCH

from verify.judge.row import Row
from verify.report.progress import RunProgress


def _row(status):
    return Row("op", "fam", "a -> a", 2, "a=2", "float32", 0, status)


def test_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    with RunProgress(2, stream=out) as p:
        p.start("relu")
        p.done("relu", [_row(MATCH), _row(MISMATCH)])
        p.start("model:nanogpt dp")
        p.done("model:nanogpt dp", [_row(MATCH)])
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "\x1b" not in out.getvalue()
    assert lines[0].lstrip().startswith("[1/2] relu") and "1 failed" in lines[0]
    assert lines[1].lstrip().startswith("[2/2] model:nanogpt dp") and "0 failed" in lines[1]


def test_a_bar_with_eta_on_a_terminal():
    out = io.StringIO()
    with RunProgress(3, stream=out, force_terminal=True) as p:
        p.start("model:llama tp")
        p.done("model:llama tp", [_row(MATCH)])
    text = out.getvalue()
    assert "\x1b[" in text and "1/3" in text and "ETA" in text and "model:llama tp" in text


def test_the_eta_counts_from_recorded_times_and_failures_so_far_are_shown():
    out = io.StringIO()
    with RunProgress(3, [10.0, 10.0, 100.0], stream=out) as p:
        p.start("a")
        p._t0 -= 20.0  # the first unit took twice its record: what is left is expected twice as slow
        p.done("a", [_row(MISMATCH)])
        assert 210 <= p.eta() <= 230
        p.start("b")
        p.done("b", [_row(MATCH)], cached=True)
    lines = out.getvalue().splitlines()
    assert "1 failed so far" in lines[0] and "ETA 3:" in lines[0]
    assert "cached" in lines[1] and "1 failed so far" in lines[1]
