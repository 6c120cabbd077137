"""A model that draws random numbers (dropout), verified in this process (``verify.cli.main``, its rank
gang forked from here): the draws of a step are replayed equally in the run and its references, so a
correct plan matches; micro-batches, which draw per piece, leave the row unverifiable naming the op. In
process, so that a harness mutant of the draws (``tests/mutants/harness``) reaches the run."""
from __future__ import annotations

from pathlib import Path

from verify.cli import main

FIXTURE = Path(__file__).parents[1] / "fixtures" / "dropout_model.py"


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
