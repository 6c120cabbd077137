"""Pipelined training on real ranks against single-device training on the whole batch: loss, every
gradient and every parameter after 3 AdamW steps (``verify/cases/model.py``), 4 micro-batches; data-
parallel replicas of a whole pipeline (``verify/cases/replicas.py``); 3-D meshes at W=8 (pp2 x
dp2 x tp2, the dp axis inside the stages or as replicas); and the known-wrong runtimes of
``tests/fixtures/pipeline_mutants.py`` caught, each by its own check."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from verify.judge.verdict import ERROR, MATCH, MISMATCH, TIMEOUT

from verify.config import RunConfig

from verify.rows.run import run_model
from tests.conftest import MODULES
from verify.runner.gang import Gang, max_ranks
from verify.cases.pipeline import SWEPT, pipeline_applies
from verify.rows.replicas import run_replicas
from verify.runner.worker import load_modules

MUTANTS = str(Path(__file__).parents[1] / "fixtures" / "pipeline_mutants.py")
MODELS = ("nanogpt", "llama", "gpt2", "bert", "transformer_encoder")


def _row(gang, name, policy, world, steps=3, modules=()):
    with tempfile.TemporaryDirectory() as tmp:
        (row,) = run_model(gang, name, (policy,), RunConfig(world_sizes=(world,), modules=modules), tmp, steps=steps)
    return row


@pytest.mark.parametrize("name,policy,world", [
    ("nanogpt", "pp", 2),
    pytest.param("gpt2", "pp2_tp_gpipe", 4, marks=pytest.mark.slow)])
def test_pipelines_match_one_device(gang, name, policy, world):
    row = _row(gang, name, policy, world, steps=2)
    assert row.status == MATCH, (row.detail, row.traceback)
    assert row.partition == f"{policy} mb4"


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("policy", SWEPT + ("pp_interleaved", "pp_zb"))
@pytest.mark.parametrize("name", MODELS)
def test_every_model_under_every_pipeline(gang, name, policy, world):
    if not pipeline_applies(policy, world):
        pytest.skip(f"{policy} needs more ranks than {world}")
    row = _row(gang, name, policy, world)
    assert row.status == MATCH, (row.detail, row.traceback)


def _replica_row(gang, name, policy, world, replicas=2, steps=2, modules=(), bucket_bytes=None):
    with tempfile.TemporaryDirectory() as tmp:
        (row,) = run_replicas(gang, name, (policy,), RunConfig(world_sizes=(world,), modules=modules), tmp, replicas,
                              steps=steps, bucket_bytes=bucket_bytes)
    return row


@pytest.mark.parametrize("name,policy,bucket_bytes", [("nanogpt", "pp", None),
                                                      ("padded_gpt", "pp_zb", 512)])  # uneven shares, small buckets
def test_replicas_of_a_whole_pipeline_train_like_one_device_on_the_whole_batch(gang, name, policy, bucket_bytes):
    """A pipeline on 2 ranks x 2 replicas: each replica pipelines its share in 4 micro-batches;
    gradients averaged over replicas once (in the model's buckets, or many small ones), the loss
    weighted over the whole batch (exactly, also when the shares hold different numbers of targets);
    the checkpoint resumes."""
    row = _replica_row(gang, name, policy, 4, bucket_bytes=bucket_bytes)
    assert (row.status, row.detail) == (MATCH, ""), row.traceback
    assert row.partition == f"{policy} x2 replicas"


@pytest.fixture(scope="module")
def gang8(registry):
    if max_ranks() < 8:
        pytest.skip("this machine runs fewer than 8 ranks")
    with Gang(8, MODULES, (8,)) as g:
        yield g


@pytest.mark.slow  # the 8-rank gang alone takes 40 s to start on 2 loaded cores
@pytest.mark.parametrize("name", ["nanogpt", "llama"])
@pytest.mark.parametrize("policy,replicas", [("pp2_hybrid", 1),  # 2 stages, each dp2 x tp2 over its 4 ranks
                                             ("pp2_tp", 2),  # 2 replicas of 2 stages, each tp2
                                             ("pp2_hybrid", 2)])  # the same with hybrid stages (tp2 at 2 ranks)
def test_three_d_meshes_at_eight_ranks(gang8, name, policy, replicas):
    if name == "llama":
        pytest.importorskip("transformers")
    row = _replica_row(gang8, name, policy, 8, replicas) if replicas > 1 else _row(gang8, name, policy, 8, steps=2)
    assert (row.status, row.detail) == (MATCH, ""), row.traceback


@pytest.fixture(scope="module")
def mutant_gang(registry):
    load_modules((MUTANTS,))
    with Gang(4, (MUTANTS,), (2, 4)) as g:
        yield g


def test_replica_gradients_of_a_pipeline_divided_by_one_replicas_count_are_caught(mutant_gang):
    row = _replica_row(mutant_gang, "nanogpt", "pp", 4, steps=1, modules=(MUTANTS,))
    assert row.status == MISMATCH and row.detail.startswith(("loss", "grad")), row.detail


@pytest.mark.parametrize("name,policy,needle", [("nanogpt", "pp_gpipe", "grad "),  # gradients 4x too large
                                                ("gpt2", "pp", "grad model.transformer.wte.weight")])
def test_a_known_wrong_pipeline_is_caught(mutant_gang, name, policy, needle):
    row = _row(mutant_gang, name, policy, 2, steps=1, modules=(MUTANTS,))
    assert row.status == MISMATCH and row.detail.startswith(needle), row.detail


def test_a_failing_stage_is_a_failed_row_with_its_reason(mutant_gang):
    row = _row(mutant_gang, "nanogpt", "pp_interleaved", 2, steps=1, modules=(MUTANTS,))
    assert row.status in (ERROR, TIMEOUT), row.detail
    assert "injected failure of the last stage on rank 1" in row.detail + (row.traceback or ""), row.detail


def test_stages_failing_on_every_rank_name_every_ranks_reason(mutant_gang):
    row = _row(mutant_gang, "nanogpt", "pp_zb", 4, steps=1, modules=(MUTANTS,))
    assert row.status == ERROR, row.detail
    for rank, stages in enumerate([[0, 4], [1, 5], [2, 6], [3, 7]]):
        want = f"rank {rank}: RuntimeError: injected failure of stages {stages} on rank {rank}"
        assert want in row.detail, row.detail
