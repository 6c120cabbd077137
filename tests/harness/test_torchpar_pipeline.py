"""Users' pipelines (``torch.distributed.pipelining``) verified against one device (``verify model
--parallelize`` returning stages and a schedule, on a mesh with ``pp``): GPipe, 1F1B (returned as
torchtitan's ``pipeline_llm`` returns it), interleaved 1F1B and interleaved zero bubble with two stages per
rank, and FSDP2 over dp x 1F1B over pp match, resume included; a loss not averaged over micro-batches, a stage
that drops a layer and stages out of order are MISMATCH naming what is wrong; bad input is one line, exit 2.
The user's file: ``tests/fixtures/torchpar_pipeline.py``."""
from __future__ import annotations

from pathlib import Path

import pytest

from verify.cases.torchpar.mesh import parse_mesh
from verify.cases.torchpar.pipeline import find_prefix, layout_check
from verify.cli import main
from verify.config import RunConfig
from verify.judge.verdict import MATCH, MISMATCH
from verify.rows.torchpar import run_torchpar

USER = str(Path(__file__).parents[1] / "fixtures" / "torchpar_pipeline.py")


def _row(gang, fn, tmp_path, mesh="pp", w=2, steps=2, checkpoint=True):
    (row,) = run_torchpar(gang, f"{USER}:build", f"{USER}:{fn}", parse_mesh(mesh), RunConfig(world_sizes=(w,)),
                          str(tmp_path), steps=steps, checkpoint=checkpoint)
    return row


@pytest.mark.parametrize("fn, mesh, w, schedule", [
    ("gpipe", "pp", 2, "ScheduleGPipe, 2 stages over pp=2"),
    ("one_f_one_b", "pp", 2, "Schedule1F1B, 2 stages over pp=2"),  # torchtitan's (schedule, parts, first, last)
    ("interleaved", "pp", 2, "ScheduleInterleaved1F1B, 4 stages over pp=2"),
    ("zero_bubble", "pp", 2, "ScheduleInterleavedZeroBubble, 4 stages over pp=2"),
    ("dp_pp", "dp=2,pp=2", 4, "Schedule1F1B, 2 stages over pp=2, 2 micro-batches")])
def test_pipelines_match_one_device(gang, tmp_path, fn, mesh, w, schedule):
    """The loss from the last stage, every gradient and AdamW update from the stage holding it, and the DCP
    resume on one device (the row's expected checks include the resumed ones)."""
    row = _row(gang, fn, tmp_path, mesh, w)
    assert row.status == MATCH, row.detail
    assert f"pp: {schedule}" in row.detail, row.detail


def test_fsdp_division_disabled_as_torchtitan_ships_it_matches(gang, tmp_path):
    """The loss_fn divides by the global token count and FSDP sums: the step's loss is the sum over dp."""
    row = _row(gang, "dp_pp_undivided", tmp_path, "dp=2,pp=2", 4, steps=1, checkpoint=False)
    assert row.status == MATCH, row.detail
    assert "fsdp loss scale: FSDP2 gradient division disabled (over dp=2)" in row.detail, row.detail


def test_a_loss_not_averaged_over_micro_batches_is_caught(gang, tmp_path):
    row = _row(gang, "not_averaged", tmp_path, steps=1, checkpoint=False)
    assert row.status == MISMATCH and row.detail.startswith("loss step 0"), row.detail


def test_a_stage_that_drops_a_layer_is_named(gang, tmp_path):
    row = _row(gang, "drops_layer", tmp_path, steps=1)
    assert row.status == MISMATCH, row.detail
    assert row.detail.startswith("stage layout on rank 0: no stage holds layers.1 ("), row.detail
    assert "stage 1 holds norm, output" in row.detail, row.detail


def test_stages_out_of_order_are_named(gang, tmp_path):
    row = _row(gang, "misordered", tmp_path, steps=1, checkpoint=False)
    assert row.status == MISMATCH, row.detail
    assert row.detail.startswith("stage layout on rank 0: stage 0 holds model.layers.1."), row.detail
    assert "not in the model's order" in row.detail and "stage 0 holds tok_embeddings, layers.1" in row.detail


def test_layout_and_prefix_rules():
    """The stage layout check on its own: a right split passes, each wrong one fails with its reason."""
    order = ["m.emb", "m.l.0.a", "m.l.1.a", "m.out"]
    assert layout_check({0: ["m.emb", "m.l.0.a"], 1: ["m.l.1.a", "m.out"]}, order, "m.").ok
    lost = layout_check({0: ["m.emb", "m.l.0.a"], 1: ["m.out"]}, order, "m.")
    assert not lost.ok and lost.reason.startswith("no stage holds l.1"), lost.reason
    twice = layout_check({0: ["m.emb", "m.l.0.a"], 1: ["m.l.0.a", "m.l.1.a", "m.out"]}, order, "m.")
    assert not twice.ok and "m.l.0.a is held by stages [0, 1]" in twice.reason, twice.reason
    swapped = layout_check({0: ["m.emb", "m.l.1.a"], 1: ["m.l.0.a", "m.out"]}, order, "m.")
    assert not swapped.ok and "stage 0 holds m.l.1.a, which one device runs after m.l.0.a" in swapped.reason
    assert find_prefix(["l.0.a.weight"], {"m.l.0.a.weight", "m.out.weight"}) == "m."
    assert find_prefix(["l.0.a.weight"], {"m.l.1.a.weight"}) is None


@pytest.mark.parametrize("fn, mesh, message", [
    ("stages_only", "pp", "returned pipeline stages with no schedule"),
    ("gpipe", "tp", "returned a pipeline but the mesh has no dimension named 'pp'")])
def test_bad_pipeline_input_is_one_line_exit_2_before_ranks_start(capsys, fn, mesh, message):
    code = main(["model", f"{USER}:build", "--parallelize", f"{USER}:{fn}", "--mesh", mesh, "--world-size", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
