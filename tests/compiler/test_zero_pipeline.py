"""ZeRO with pipelines (``ComputeConfig(zero=...)`` and a pipeline policy): each stage's optimizer
state (gradients, parameters) sharded over its data-parallel ranks (the stage plan's ``dp`` axis and
the replicas); training equals one device, checkpoints resume, a parameter tied across stages stays
right (synced whole, then sliced), and zero 3 under a zero-bubble schedule is refused in one line
before any rank starts."""
from __future__ import annotations

import tempfile

import pytest

from nnscaler import ComputeConfig, PlanError, parallelize
from verify.judge.verdict import MATCH, judge
from verify.models.registry import MODELS


def _model(gang, name, policy, world_size, zero, plan_ngpus=None, **recipe):
    with tempfile.TemporaryDirectory() as tmp:
        job = {"kind": "model", "model": name, "policy": policy, "world_size": world_size, "steps": 2, "seed": 0,
               "gen_dir": tmp, "recipe": {"zero": zero, **recipe}}
        if plan_ngpus:
            job["plan_ngpus"] = plan_ngpus
        return judge(gang.run(job, world_size, 600))


def test_zero_2_over_pipeline_replicas_trains_like_one_device_and_resumes(gang):
    status, detail, checks, _ = _model(gang, "nanogpt", "pp", 4, 2, plan_ngpus=2)
    assert status == MATCH, detail
    names = [c["name"] for c in checks]
    assert any(n.startswith("resumed on one device: optimizer exp_avg") for n in names)


def test_zero_3_over_pipeline_replicas_trains_like_one_device_and_resumes(gang):
    status, detail, checks, _ = _model(gang, "nanogpt", "pp", 4, 3, plan_ngpus=2)
    assert status == MATCH, detail
    names = [c["name"] for c in checks]
    assert any(n.startswith("resumed on one device: optimizer exp_avg") for n in names)


def test_bf16_mixed_with_zero_3_over_pipeline_replicas_trains_like_one_device_and_resumes(gang):
    """bf16-mixed over pipeline replicas (the harness refused it: its replica case ran 32-true only), with
    zero 3, full recompute and clipping: judged by the bf16 rule against the same recipe on one device."""
    status, detail, checks, _ = _model(gang, "nanogpt", "pp", 4, 3, plan_ngpus=2, precision="bf16-mixed",
                                       recompute="full", clip_grad_norm=1.0)
    assert status == MATCH, detail
    names = [c["name"] for c in checks]
    assert any(n.startswith("resumed on one device: optimizer exp_avg") for n in names)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [2, 3])
def test_zero_over_stage_dp_ranks_with_a_tied_embedding_and_clipping_trains_like_one_device(gang, zero):
    # gpt2's embedding is tied to its head across the stages: summed across them, not reduce-scattered
    status, detail, _, _ = _model(gang, "gpt2", "pp2_dp", 4, zero, clip_grad_norm=0.5)
    assert status == MATCH, detail


def test_a_pipeline_s_rows_carry_memory_and_zero_1_halves_each_stage_s_optimizer_state(gang):
    from verify.config import RunConfig
    from verify.rows.run import run_model
    mem = {}
    with tempfile.TemporaryDirectory() as tmp:
        for zero in (0, 1):
            (row,) = run_model(gang, "nanogpt", ("pp2_dp",), RunConfig(world_sizes=(4,), zero=zero), tmp, steps=1,
                               checkpoint=False)
            assert row.status == MATCH, row.detail
            mem[zero] = row.memory
    for r in range(4):  # each stage's two dp ranks hold half of its AdamW moments
        assert abs(mem[1][r]["optimizer"] / mem[0][r]["optimizer"] - 0.5) < 0.01


def test_zero_3_under_a_zero_bubble_schedule_or_no_stage_dp_ranks_is_one_line_before_any_process_group():
    case = MODELS["nanogpt"](0)  # no process group exists here: the refusal comes first
    with pytest.raises(PlanError, match=r"^zero=3 with the InterleavedZeroBubble schedule is not available") as err:
        parallelize(case.model, case.batch(0), "pp_zb", ComputeConfig(2, runtime_ngpus=4, zero=3, num_microbatches=4),
                    verify=False, gen_savedir=tempfile.mkdtemp())
    assert "\n" not in str(err.value)
    with pytest.raises(PlanError, match=r"^zero=1 needs a data-parallel axis, but the dp stage plan"):
        parallelize(case.model, case.batch(0), "pp", ComputeConfig(2, zero=1, num_microbatches=4), verify=False,
                    gen_savedir=tempfile.mkdtemp())
