"""Meshes of up to 4 dimensions under ``verify model --parallelize`` (torchtitan's ``dp_replicate``,
``dp_shard`` both split the batch), meshes a program lays itself (``init_device_mesh`` and
``_unflatten``, as torchtitan's ``ParallelDims`` does) built from the gang's groups, and a resume through
``model.state_dict()`` for models whose state-dict hooks rename their keys; torch only
(``tests/fixtures/torchpar_meshes.py``)."""
from __future__ import annotations

from pathlib import Path

import pytest

from verify.cases.torchpar.mesh import MeshSpecError, parse_mesh
from verify.config import RunConfig
from verify.judge.verdict import MATCH, MISMATCH
from verify.rows.torchpar import run_torchpar

USER = str(Path(__file__).parents[1] / "fixtures" / "torchpar_meshes.py")


def _row(gang, build, fn, mesh, w, tmp_path, steps=2, checkpoint=True):
    (row,) = run_torchpar(gang, f"{USER}:{build}", f"{USER}:{fn}", parse_mesh(mesh), RunConfig(world_sizes=(w,)),
                          str(tmp_path), steps=steps, checkpoint=checkpoint)
    return row


def test_meshes_of_up_to_four_dimensions_parse():
    assert parse_mesh("pp=1,dp_replicate=2,dp_shard=2,tp=2") == (("pp", 1), ("dp_replicate", 2), ("dp_shard", 2),
                                                                  ("tp", 2))
    with pytest.raises(MeshSpecError, match="at most 4 dimensions"):
        parse_mesh("a=1,b=1,c=1,d=1,e=2")
    with pytest.raises(MeshSpecError, match="give every size"):
        parse_mesh("dp_replicate=2,dp_shard,tp=2")


def test_hsdp_with_tensor_parallelism_on_a_3d_mesh_matches(gang, tmp_path):
    """dp_replicate=1 x dp_shard=2 x tp=2: HSDP over the first two, torchtitan's TP plan over tp; the size-1
    dimension's one-rank groups are made locally."""
    row = _row(gang, "build", "hsdp_tp", "dp_replicate=1,dp_shard=2,tp=2", 4, tmp_path)
    assert row.status == MATCH, row.detail


def test_a_plan_that_forgets_to_average_over_dp_replicate_x_dp_shard_is_caught(gang, tmp_path):
    """Both torchtitan data dimensions split the batch: a module never synchronised is MISMATCH."""
    row = _row(gang, "build", "no_sync", "dp_replicate=2,dp_shard=2", 4, tmp_path, steps=1, checkpoint=False)
    assert row.status == MISMATCH and "grad" in row.detail, row.detail


def test_a_mesh_the_program_lays_itself_takes_the_gangs_groups(gang, tmp_path):
    """``init_device_mesh`` over 2 ranks of the 4-rank gang, then ``_unflatten`` (each dimension a
    ``new_group``, collective over the whole world): answered from the gang's groups, it trains and matches."""
    row = _row(gang, "build", "own_mesh_hsdp", "dp_replicate=2,dp_shard=1", 2, tmp_path, steps=1, checkpoint=False)
    assert row.status == MATCH, row.detail


def test_state_dict_hooks_resume_through_the_models_own_state_dict(gang, tmp_path):
    """``get_model_state_dict`` cannot map the hooks' keys back to parameters: the model's own
    ``state_dict()`` / ``load_state_dict()`` carry the resume, the row says so and matches."""
    row = _row(gang, "build_hooked", "fsdp", "dp", 2, tmp_path)
    assert row.status == MATCH, row.detail
    assert "model saved and loaded through model.state_dict()" in row.detail, row.detail


def test_state_dict_hooks_that_load_wrong_are_caught(gang, tmp_path):
    """The same save, a load hook that swaps the halves back: caught at once (the harness copies the
    model's initial state to its single-device twin through the same hooks), naming the parameter."""
    row = _row(gang, "build_hooked_wrong", "fsdp", "dp", 2, tmp_path, steps=1)
    assert row.status == MISMATCH and "attention.wq.weight" in row.detail, row.detail


def test_a_batch_that_does_not_divide_over_the_data_dims_is_one_line_exit_2(capsys):
    from verify.cli import main
    code = main(["model", f"{USER}:build", "--parallelize", f"{USER}:no_sync", "--mesh", "dp_replicate=2,dp_shard=4",
                 "--world-size", "8"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "does not divide over dp_replicate x dp_shard=8" in err, err
