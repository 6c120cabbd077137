"""The harness's own reload of a checkpoint under another plan never fails a correct program: a ``tp``
row at W=3 (dp cannot split the batch of 8 over 3 ranks) reloads under the first plan that fits, or
matches with a note saying why none does."""
from __future__ import annotations

from pathlib import Path

from verify.config import RunConfig
from verify.judge.verdict import MATCH
from verify.rows.run import run_model
from verify.runner.gang import Gang

USER = str(Path(__file__).parents[1] / "fixtures" / "user_model.py") + ":build"


def test_a_tp_row_at_three_ranks_reloads_under_a_plan_that_fits(tmp_path):
    with Gang(3, (), (3,)) as gang:
        rows = list(run_model(gang, USER, ("tp",), RunConfig(world_sizes=(3,)), str(tmp_path), steps=1))
    assert [r.status for r in rows] == [MATCH], rows[0].detail + rows[0].traceback
    assert rows[0].detail == "" or rows[0].detail.startswith("no other plan reloads the checkpoint: dp: "), rows[0].detail
