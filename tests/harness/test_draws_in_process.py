"""A model that draws random numbers (dropout), verified in this process (``verify.cli.main``, its rank
gang forked from here): the draws of a step are replayed equally in the run and its references, so a
correct plan matches; micro-batches, which draw per piece, leave the row unverifiable naming the op. In
process, so that a harness mutant of the draws (``tests/mutants/harness``) reaches the run."""
from __future__ import annotations

import json
from pathlib import Path

from verify.cli import main

FIXTURE = Path(__file__).parents[1] / "fixtures" / "dropout_model.py"
WRONG = Path(__file__).parents[1] / "fixtures" / "split_dropout.py"


def test_a_correct_plan_of_a_model_that_draws_matches(tmp_path, capsys):
    rc = main(["model", f"{FIXTURE}:build", "--policy", "dp", "--world-size", "2", "--reports", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "1 cases, 1 match" in out.replace("1 case,", "1 cases,"), out[-3000:]


def test_micro_batches_leave_a_model_that_draws_unverifiable(tmp_path, capsys):
    main(["model", f"{FIXTURE}:build", "--policy", "dp", "--world-size", "2", "--microbatches", "2",
          "--reports", str(tmp_path)])
    out = capsys.readouterr().out
    assert "unverifiable" in out and "MISMATCH" not in out, out[-3000:]
    assert "dropout (aten.dropout.default) at" in out


def test_a_draw_split_per_shard_is_caught_at_the_operator_and_the_right_kernel_is_bound_at_rounding(tmp_path, capsys):
    """``rand_like`` draws other numbers in float64 than in float32: unless the operator case's float64
    reference redraws the run's numbers, its bound grows to the size of the draws and a per-shard draw matches."""
    main(["op", "shard_draw_rand_like", "--world-size", "2", "--module", str(WRONG), "--reports", str(tmp_path / "w")])
    out = capsys.readouterr().out
    assert "3 cases, 1 match, 2 MISMATCH" in out, out[-3000:]
    report = tmp_path / "right.json"
    rc = main(["op", "rule.rand_like.0", "--world-size", "2", "--json", str(report), "--reports", str(tmp_path / "r")])
    out = capsys.readouterr().out
    assert rc == 0 and "4 cases, 4 match" in out, out[-3000:]
    data = json.loads(report.read_text())
    rows = data if isinstance(data, list) else data["rows"]
    assert rows and all(r["out_tol"] < 1e-4 for r in rows), [r["out_tol"] for r in rows]
