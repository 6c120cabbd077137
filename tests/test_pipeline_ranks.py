"""Pipelined training on real ranks against single-device training on the whole batch: loss, every
gradient and every parameter after 3 AdamW steps (``verify/model_case.py``), 4 micro-batches; and the
known-wrong runtimes of ``tests/fixtures/pipeline_mutants.py`` caught, each by its own check."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from verify.cases import ERROR, MATCH, MISMATCH, TIMEOUT, RunConfig, run_model
from verify.gang import Gang
from verify.pipeline_case import SWEPT, pipeline_applies
from verify.worker import load_modules

MUTANTS = str(Path(__file__).parent / "fixtures" / "pipeline_mutants.py")
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


@pytest.fixture(scope="module")
def mutant_gang(registry):
    load_modules((MUTANTS,))
    with Gang(2, (MUTANTS,), (2,)) as g:
        yield g


@pytest.mark.parametrize("name,policy,needle", [("nanogpt", "pp_gpipe", "grad "),  # gradients 4x too large
                                                ("gpt2", "pp", "grad model.transformer.wte.weight")])
def test_a_known_wrong_pipeline_is_caught(mutant_gang, name, policy, needle):
    row = _row(mutant_gang, name, policy, 2, steps=1, modules=(MUTANTS,))
    assert row.status == MISMATCH and row.detail.startswith(needle), row.detail


def test_a_failing_stage_is_a_failed_row_with_its_reason(mutant_gang):
    row = _row(mutant_gang, "nanogpt", "pp_interleaved", 2, steps=1, modules=(MUTANTS,))
    assert row.status in (ERROR, TIMEOUT), row.detail
    assert "injected failure of the last stage on rank 1" in row.detail + (row.traceback or ""), row.detail
