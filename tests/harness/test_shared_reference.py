"""A whole-model case's single-device reference runs on the case's rank 0 alone and reaches its other
ranks (``verify/cases/reference.py``); each rank still judges its own parallel tensors against it."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from verify.config import RunConfig
from verify.cases.model import expected_checks
from verify.judge.verdict import ERROR, MATCH, MISMATCH, judge
from verify.runner.gang import Gang
from verify.rows.run import run_model
from verify.runner.worker import load_modules

FIXTURE = str(Path(__file__).parents[1] / "fixtures" / "reference_ranks.py")


@pytest.fixture(scope="module")
def ref_gang(registry):
    load_modules((FIXTURE,))  # the parent lists the checks every rank must return, from the model
    with Gang(4, (FIXTURE,), (2, 4)) as g:
        yield g


@pytest.mark.parametrize("policy,world,recipe", [("dp", 2, {"clip_grad_norm": 1.0}),
                                                 ("tp", 4, {"precision": "bf16-mixed"}),
                                                 ("dp", 4, {})])
def test_only_rank_0_runs_the_float64_reference(ref_gang, policy, world, recipe):
    """The model raises where it runs in float64 on another rank: training steps, clipping, the moved
    points of a bf16 recipe, the reload and the resumed run (at W=4 under a 2-D plan) all match."""
    cfg = RunConfig(world_sizes=(world,), modules=(FIXTURE,), **recipe)
    with tempfile.TemporaryDirectory() as tmp:
        (row,) = run_model(ref_gang, "float64_on_rank0", (policy,), cfg, tmp, steps=2)
    assert row.status == MATCH, row.detail


def test_a_fault_only_rank_1_sees_is_caught_on_rank_1(ref_gang):
    """Under dp each rank's parameters are its own; rank 1 loads one weight off, rank 0 loads right.
    Rank 1 judges its own state against rank 0's reference and fails its load check, which rank 0
    passes (the gradients, all-reduced, then fail on both)."""
    job = {"kind": "model", "model": "nudged_rank1_load", "policy": "dp", "world_size": 2, "steps": 2, "seed": 0,
           "dtype": "float32", "checkpoint": False}
    with tempfile.TemporaryDirectory() as tmp:
        answers = ref_gang.run(dict(job, gen_dir=tmp), 2, 300)
    failed = [{c["name"] for c in a.result["checks"] if not c["ok"]} for a in answers]
    assert "load step 0" in failed[1] and "load step 0" not in failed[0], failed
    status, detail, _, _ = judge(answers, expected_checks("nudged_rank1_load", "dp", 2, 0, checkpoint=False))
    assert status == MISMATCH and detail.startswith("load step 0"), detail


def test_a_reference_that_raises_on_rank_0_fails_every_rank_at_once(ref_gang):
    """Rank 0's error reaches the ranks waiting for its result: each raises at once (no rank waits out
    the case's limit), and the row names rank 0's own error."""
    cfg = RunConfig(world_sizes=(4,), modules=(FIXTURE,))
    with tempfile.TemporaryDirectory() as tmp:
        (row,) = run_model(ref_gang, "float64_fails", ("dp",), cfg, tmp, steps=1)
    assert row.status == ERROR and row.detail.startswith("rank 0: RuntimeError: no float64 here"), row.detail
    assert "ReferenceFailed: the single-device reference failed on rank 0" in row.detail, row.detail
    assert "gave no answer" not in row.detail and row.seconds < 60, row
