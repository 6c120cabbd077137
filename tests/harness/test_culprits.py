"""Rows that name the culprit of a torch program where no module does: a rank aborted by a collective whose
sizes differ (its standard error, read back from the gang's files, and the module it was in: 
``verify/runner/rank_logs.py``), and a loss normalised per rank (``verify/cases/torchpar/localize.py``)."""
from __future__ import annotations

from pathlib import Path

from verify.cases.torchpar.mesh import parse_mesh
from verify.config import RunConfig
from verify.judge.verdict import MISMATCH
from verify.rows.torchpar import run_torchpar
from verify.runner.rank_logs import telling_line

FIX = str(Path(__file__).parents[1] / "fixtures" / "torchpar_culprits.py")

GLOO = """W1128 some warning
terminate called after throwing an instance of 'gloo::EnforceNotMet'
  what():  [enforce fail at /__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:456] op.preamble.length <= op.nbytes. 8 vs 4. Received data size doesn't match expected size. Is there a distributed collective mismatch in your code?
"""


def test_the_telling_line_of_a_dying_rank():
    assert telling_line(GLOO) == ("op.preamble.length <= op.nbytes. 8 vs 4. Received data size doesn't match expected "
                                  "size. Is there a distributed collective mismatch in your code?")
    assert telling_line("Traceback (most recent call last):\n  File x\nRuntimeError: boom\n") == "RuntimeError: boom"
    assert telling_line("W1128 a warning\nnothing else\n") == ""


def test_a_collective_mismatch_that_aborts_a_rank_is_named_with_its_module(gang, tmp_path):
    (row,) = run_torchpar(gang, f"{FIX}:build", f"{FIX}:mismatched_collective", parse_mesh("tp"),
                          RunConfig(world_sizes=(2,)), str(tmp_path), steps=1, checkpoint=False)
    assert row.status == "crash", row.detail
    assert "Is there a distributed collective mismatch in your code?" in row.detail, row.detail
    assert "while in the forward of module model.layers.1.feed_forward (FeedForward)" in row.detail, row.detail


def test_a_loss_normalised_per_rank_is_named_not_the_gradient_sync(gang, tmp_path):
    """Each rank's loss is one device's on its rows, so every module matches; the mean over dp is not one
    device's loss. (A program that forgets the gradient sync keeps the "after backward" line:
    tests/harness/test_torchpar.py::test_a_plan_that_forgets_to_average_over_dp_is_caught.)"""
    (row,) = run_torchpar(gang, f"{FIX}:build", f"{FIX}:fsdp", parse_mesh("dp"), RunConfig(world_sizes=(2,)),
                          str(tmp_path), steps=1, checkpoint=False)
    assert row.status == MISMATCH and "loss step 0" in row.detail, row.detail
    assert "the loss is normalised per rank" in row.detail, row.detail
    assert "the gradient sync is not at fault" in row.detail, row.detail


TITAN = "verify/models/titan_llama.py:titan_llama"


def test_inside_the_module_the_first_divergent_operator_is_named(gang, tmp_path):
    """A missing sequence-parallel gather before attention: the module is the attention, and inside it the first
    operator that computes on wrong values is rotary's multiply (each rank's positions start at 0), not a view."""
    root = Path(__file__).parents[2]
    (row,) = run_torchpar(gang, str(root / TITAN.split(":")[0]) + ":titan_llama",
                          str(root / "verify/models/torch_plans.py") + ":wrong_missing_sp_gather", parse_mesh("tp"),
                          RunConfig(world_sizes=(2,)), str(tmp_path), steps=1, checkpoint=False)
    assert row.status == MISMATCH and "first divergent module: model.layers.0.attention (" in row.detail, row.detail
    assert "inside it, the first divergent operator of its forward: aten.mul.Tensor (operator 1 of" in row.detail, \
        row.detail


def test_an_operator_only_the_parallel_program_runs_in_backward_is_named(gang, tmp_path):
    """A gradient doubled inside the feed-forward's backward (an autograd function of the user's): the module, and
    the multiply one device never runs there."""
    root = Path(__file__).parents[2]
    (row,) = run_torchpar(gang, str(root / TITAN.split(":")[0]) + ":titan_llama", f"{FIX}:wrong_ffn_backward",
                          parse_mesh("tp"), RunConfig(world_sizes=(2,)), str(tmp_path), steps=1, checkpoint=False)
    assert row.status == MISMATCH and "first divergent module: model.layers.0.feed_forward (" in row.detail, row.detail
    assert "operators of its backward only the parallel program runs: " in row.detail, row.detail
    assert "aten.mul.Tensor" in row.detail.split("only the parallel program runs: ")[1], row.detail
