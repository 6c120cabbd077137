"""The compiler end to end: models parallelized under every policy train like on one device, a
wrong annotation inside a model is caught, and plans that cannot run are refused."""
from __future__ import annotations

import tempfile
import warnings

import pytest

from nnscaler.codegen.emit import generate
from nnscaler.policies import POLICIES, ComputeConfig, Plan, PlanError, validate
from nnscaler.trace.build import UnknownOperatorWarning, trace
from verify.judge.verdict import ERROR, MISMATCH
from verify.config import RunConfig
from verify.rows.run import run_model
from verify.models.registry import MODELS

CFG = RunConfig(world_sizes=(2, 4))


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("name", ["nanogpt", "transformer_encoder", "llama", "gpt2", "bert"])
def test_model_trains_like_on_one_device(verify_model, name, policy):
    """Through the pytest plugin, as a user's suite runs it: one subtest per (world size, policy, seed),
    a failing one carrying the tolerance message and the rerun line."""
    if name not in MODELS:
        pytest.skip(f"{name} needs transformers (pip install -e '.[models]')")
    if name == "gpt2" and policy in ("ulysses", "cp_tp_ulysses"):
        pytest.skip("gpt2's 3 heads do not divide over 2 or 4 ranks: ulysses and cp_tp_ulysses refuse it "
                    "(test_ulysses_refuses_heads_that_do_not_divide)")
    rows = verify_model(name, policies=[policy], world_sizes=CFG.world_sizes, steps=3)
    assert [(r.world_size, r.partition) for r in rows] == [(w, policy) for w in CFG.world_sizes]


def test_ulysses_refuses_heads_that_do_not_divide(gang, registry):
    """Ulysses splits heads inside attention: gpt2's 3 heads over 2 ranks is an error row naming why."""
    with tempfile.TemporaryDirectory() as tmp:
        (row,) = run_model(gang, "gpt2", ("ulysses",), RunConfig(world_sizes=(2,)), tmp, steps=1)
    assert row.status == ERROR and "cannot split its heads over 2 ranks" in row.detail, row.detail


def test_a_wrong_annotation_inside_a_model_is_caught(gang, registry):
    with tempfile.TemporaryDirectory() as tmp:
        rows = list(run_model(gang, "wrong_softmax_head", ("tp", "dp"), RunConfig(world_sizes=(2,)), tmp, steps=1))
    status = {r.partition: r for r in rows}
    assert status["tp"].status == MISMATCH, status["tp"].detail  # tp splits the softmax's row
    # dp splits only the batch: training matches; only reloading its checkpoint under tp goes wrong
    assert status["dp"].status == MISMATCH and status["dp"].detail.startswith("loss of the checkpoint under tp")


@pytest.fixture(scope="module")
def gpt_graph():
    case = MODELS["nanogpt"](0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnknownOperatorWarning)
        return trace(case.model, case.batch(0))


def test_policies_give_valid_plans_and_tp_splits_like_megatron(gpt_graph):
    for name, policy in POLICIES.items():
        config = ComputeConfig(4, tp_size=2)
        validate(policy(gpt_graph, config), gpt_graph, config)
    plan = POLICIES["tp"](gpt_graph, ComputeConfig(2))
    linears = [plan.partition(op).label for op in gpt_graph.ops if op.overload == "aten.linear.default"]
    assert linears[2:4] == ["n=2", "k=2"]  # the MLP: column- then row-split
    emb = next(op for op in gpt_graph.ops if op.overload == "aten.embedding.default")
    assert plan.partition(emb).label.startswith("v=")  # vocabulary-parallel embedding


def test_a_plan_that_leaves_an_operator_without_ranks_is_refused(gpt_graph):
    config = ComputeConfig(2)
    plan = POLICIES["dp"](gpt_graph, config)
    victim = next(iter(plan.partitions))
    del plan.partitions[victim]
    with pytest.raises(PlanError, match=f"left operator {victim}"):
        validate(plan, gpt_graph, config)
    with pytest.raises(PlanError, match="plan_ngpus=4"):
        validate(Plan((2,), ("dp",)), gpt_graph, ComputeConfig(4))
    with pytest.raises(PlanError, match="multiple of plan_ngpus"):
        ComputeConfig(4, runtime_ngpus=6)


def test_generated_code_is_plain_torch_with_source_comments(gpt_graph):
    plan = POLICIES["tp"](gpt_graph, ComputeConfig(2))
    source, shards, collectives = generate(gpt_graph, plan, 1)
    compile(source, "plan_rank_1.py", "exec")
    assert "def forward(p, g, idx, targets):" in source
    assert "linear" in source and "C.all_reduce(" in source and "C.grad_all_reduce(" in source
    assert "nanogpt.py" in source  # comments point back to the model's lines
    assert {s.name for s in shards} == {n for n, _ in MODELS["nanogpt"](0).model.named_parameters()}
    assert collectives > 0


def test_torchrun_replicas_and_reuse_of_generated_code(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from verify.torchrun import command
    script = Path(__file__).parents[1] / "fixtures" / "replicas_script.py"
    r = subprocess.run(command(["--nproc_per_node", "4", str(script), str(tmp_path)]),  # loopback-only torchrun
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "REPLICAS OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
