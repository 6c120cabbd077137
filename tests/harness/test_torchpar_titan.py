"""torchtitan as shipped under ``verify model --parallelize`` (``tests/fixtures/titan_shipped.py``): its own
Llama 3, Qwen3-MoE and DeepSeek-V3 debug models (shrunk for CPU) parallelized by its own ``parallelize_llama``
/ ``parallelize_qwen3`` / ``parallelize_deepseekv3``, with its own ``ParallelDims`` laying its meshes from the gang's groups: TP, TP+SP,
FSDP, HSDP, FSDP x TP, activation checkpointing and expert parallelism match one device, each resumed
through the model's own state dict (torchtitan's fused-QKV hooks); a config whose tensor parallelism spans
ranks holding different data is caught. torchtitan is the ``titan`` extra (in ``test``)."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is the 'titan' extra (pip install -e '.[test]' has it)")

from verify.cases.torchpar.mesh import parse_mesh  # noqa: E402
from verify.config import RunConfig  # noqa: E402
from verify.judge.verdict import MATCH, MISMATCH  # noqa: E402
from verify.rows.torchpar import run_torchpar  # noqa: E402

USER = str(Path(__file__).parents[1] / "fixtures" / "titan_shipped.py")
RESUMED = "model saved and loaded through model.state_dict()"


def _row(gang, build, fn, mesh, w, tmp_path, steps=2, checkpoint=True):
    (row,) = run_torchpar(gang, f"{USER}:{build}", f"{USER}:{fn}", parse_mesh(mesh), RunConfig(world_sizes=(w,)),
                          str(tmp_path), steps=steps, checkpoint=checkpoint)
    return row


@pytest.mark.parametrize("build, fn, mesh, w", [
    ("build", "tp", "tp", 2),
    ("build_sp", "fsdp_tp", "dp_shard=2,tp=2", 4),
    pytest.param("build_sp", "tp", "tp", 4, marks=pytest.mark.slow),
    ("build", "fsdp", "dp_shard", 2),
    ("build", "fsdp", "dp_replicate=2,dp_shard=2", 4),
    ("build", "fsdp_ac", "dp_shard", 2),
    pytest.param("build_sp", "fsdp_ac", "dp_shard=2,tp=2", 4, marks=pytest.mark.slow),
], ids=lambda v: str(v))
def test_parallelize_llama_as_shipped_matches_one_device(gang, tmp_path, build, fn, mesh, w):
    row = _row(gang, build, fn, mesh, w, tmp_path)
    assert row.status == MATCH, row.detail
    assert RESUMED in row.detail and "'FusedQKVLinear' object has no attribute 'wq'" in row.detail, row.detail


@pytest.mark.parametrize("build, fn, mesh, w", [
    ("build_moe", "moe_ep", "dp_shard", 2),
    pytest.param("build_moe", "moe_ep", "dp_shard=2,tp=2", 4, marks=pytest.mark.slow),
    pytest.param("build_dsv3", "dsv3_ep", "dp_shard", 2, marks=pytest.mark.slow)], ids=lambda v: str(v))
def test_moe_models_with_expert_parallelism_match_one_device(gang, tmp_path, build, fn, mesh, w):
    """parallelize_qwen3 on the Qwen3-MoE debug model; parallelize_deepseekv3 on DeepSeek-V3's (MLA attention)."""
    row = _row(gang, build, fn, mesh, w, tmp_path)
    assert row.status == MATCH, row.detail


def test_tensor_parallelism_over_ranks_holding_different_data_is_caught(gang, tmp_path):
    """torchtitan told tp=2 while the two ranks are the harness's dp_shard (each its own half of the batch)."""
    row = _row(gang, "build", "tp_over_every_rank", "dp_shard", 2, tmp_path, steps=1, checkpoint=False)
    assert row.status == MISMATCH, row.detail
