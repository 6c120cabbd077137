"""Users' own context parallelism (torch's ``context_parallel``, ring attention) verified on CPU ranks
(``verify model --parallelize`` with a ``cp`` mesh): the ring runs through the CPU attention kernel and
the row says so, with the rotate method and load balancing it ran under; right programs match one
device (a causal self-attention model under both rotate methods, the torchtitan-style Llama with FSDP2
over cp and its rotary cache sharded); wrong ones (gradients never reduced over cp, rotary positions
not following the load balancer's chunks) are MISMATCH naming the first wrong tensor."""
from __future__ import annotations

from pathlib import Path

import pytest

from verify.cases.torchpar.mesh import parse_mesh
from verify.config import RunConfig
from verify.judge.verdict import MATCH, MISMATCH
from verify.rows.torchpar import run_torchpar

USER = str(Path(__file__).parents[1] / "fixtures" / "torchpar_cp.py")


def _row(gang, build, fn, tmp_path, w=2, mesh="cp", dtype="float32"):
    (row,) = run_torchpar(gang, f"{USER}:{build}", f"{USER}:{fn}", parse_mesh(mesh),
                          RunConfig(world_sizes=(w,), dtype=dtype), str(tmp_path), steps=2)
    return row


@pytest.mark.parametrize("fn, rotate", [("ring_allgather", "all_gather"), ("ring_alltoall", "all_to_all")])
def test_causal_ring_attention_matches_one_device(gang, tmp_path, fn, rotate):
    row = _row(gang, "build_attention", fn, tmp_path)
    assert row.status == MATCH, row.detail
    assert "ring attention (torch's context_parallel) run through the CPU flash-attention kernel" in row.detail
    assert f"rotate {rotate}, load balance on" in row.detail, row.detail


def test_titan_llama_with_fsdp_over_cp_matches_one_device(gang, tmp_path):
    row = _row(gang, "build_llama", "llama_cp", tmp_path)
    assert row.status == MATCH, row.detail
    assert "rotate all_to_all, load balance on" in row.detail, row.detail


@pytest.mark.parametrize("build, fn, mesh", [("build_attention", "ring_allgather", "cp"), ("build_llama", "llama_cp", "cp"),
                                             ("build_attention", "ring_alltoall", "dp=2,cp=2")])
def test_cp_over_four_ranks_matches_one_device(gang, tmp_path, build, fn, mesh):
    """cp=4 (each rank two chunks of 1 token), and dp=2 x cp=2 (the loss the mean over both)."""
    row = _row(gang, build, fn, tmp_path, w=4, mesh=mesh)
    assert row.status == MATCH, row.detail
    assert "load balance on" in row.detail, row.detail


def test_gradients_not_reduced_over_cp_are_caught(gang, tmp_path):
    row = _row(gang, "build_attention", "ring_no_grad_sync", tmp_path)
    assert row.status == MISMATCH, row.detail
    assert "grad qkv.weight step 0" in row.detail, row.detail


def test_rotary_positions_not_following_the_chunks_are_caught(gang, tmp_path):
    row = _row(gang, "build_llama", "llama_positions_unbalanced", tmp_path)
    assert row.status == MISMATCH, row.detail
    assert "loss step 0" in row.detail, row.detail


def test_float64_ring_merging_in_float32_is_caught_and_torch_options_are_restored(gang, tmp_path):
    """torch's ring merges blocks in float32 by default: a float64 run is then no float64 program
    (MISMATCH, the row saying why); told to merge in the run's dtype it matches. The second row runs
    after the first on the same ranks: torch's CP options the first program changed were restored."""
    right = _row(gang, "build_attention", "ring_merge_in_dtype", tmp_path, dtype="float64")
    assert right.status == MATCH, right.detail
    default = _row(gang, "build_attention", "ring_allgather", tmp_path, dtype="float64")
    assert default.status == MISMATCH, default.detail
    assert "merges its blocks in float32 (_cp_options.convert_to_f32" in default.detail, default.detail
