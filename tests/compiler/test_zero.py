"""ZeRO over the data-parallel ranks (``ComputeConfig(zero=1|2)``, ``verify model --zero``): training
equals one device under dp, hybrid and tp replicas, checkpoints resume across zero stages and plans,
a torch sharded optimizer applied by hand is right or refused, and bad input is one line before any
rank starts."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

from verify.cases.resume import zero_plan_b
import torch

from nnscaler import ComputeConfig, PlanError, parallelize
from verify.cli import main
from verify.judge.verdict import MATCH, judge
from verify.models.registry import MODELS

sys.path.insert(0, str(Path(__file__).parents[1] / "fixtures"))
import zero_ranks  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "fixtures"


@pytest.mark.parametrize("zero, says", [(5, "zero must be 0, 1, 2 or 3"), (True, "zero must be"), (-1, "zero must")])
def test_a_zero_stage_out_of_range_is_one_line_naming_the_option(zero, says):
    with pytest.raises(PlanError, match=r"zero") as err:
        ComputeConfig(2, zero=zero)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_zero_on_a_plan_without_data_parallel_ranks_is_refused_before_any_process_group():
    case = MODELS["nanogpt"](0)  # no process group exists here: the refusal comes first
    with pytest.raises(PlanError, match=r"^zero=1 needs a data-parallel axis, but the tp plan"):
        parallelize(case.model, case.batch(0), "tp", ComputeConfig(2, zero=1), verify=False,
                    gen_savedir=tempfile.mkdtemp())


@pytest.mark.parametrize("argv, says", [
    (["--policy", "tp", "--zero", "1"], "--zero 1: policy tp at world size 2 has no data-parallel axis"),
    (["--policy", "hybrid", "--zero", "2"], "--zero 2: policy hybrid at world size 2 has no data-parallel axis"),
    (["--policy", "tp", "--zero", "3"], "--zero 3: policy tp at world size 2 has no data-parallel axis"),
    (["--policy", "dp", "--zero", "4"], "--zero 4: zero must be 0, 1, 2 or 3"),
    (["--policy", "pp", "--zero", "1"], "--zero 1: policy pp at world size 2 whose stages have no data-parallel axis"),
    (["--policy", "pp_zb", "--replicas", "2", "--zero", "3"], "--zero 3: pipeline policy pp_zb (a zero-bubble schedule)"),
])
def test_verify_model_refuses_zero_without_data_parallel_ranks_with_exit_2(capsys, argv, says):
    assert main(["model", "nanogpt", "--world-size", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


def _model(gang, name, policy, world_size, zero, plan_ngpus=None, steps=2):
    with tempfile.TemporaryDirectory() as tmp:
        job = {"kind": "model", "model": name, "policy": policy, "world_size": world_size, "steps": steps,
               "seed": 0, "gen_dir": tmp, "recipe": {"zero": zero}}
        if plan_ngpus:
            job["plan_ngpus"] = plan_ngpus
        return judge(gang.run(job, world_size, 400))


@pytest.mark.parametrize("policy, world_size, zero", [("dp", 2, 1), ("dp", 4, 2), ("hybrid", 4, 1)])
def test_zero_trains_like_one_device_and_resumes_under_another_plan(gang, policy, world_size, zero):
    status, detail, checks, _ = _model(gang, "nanogpt", policy, world_size, zero)
    assert status == MATCH, detail
    names = [c["name"] for c in checks]
    assert any(n.startswith("param") for n in names)
    # saved under zero at W, loaded on one device and under plan B (sharding its optimizer state too), moments
    # bit for bit, trained on
    other, w_b, zero_b = zero_plan_b(policy, world_size, zero)
    assert any(n.startswith("resumed on one device: optimizer exp_avg") for n in names)
    assert any(n.startswith(f"resumed under {other} zero{zero_b} at W={w_b}: optimizer exp_avg") for n in names)
    assert any(n.startswith(f"resumed under {other} zero{zero_b} at W={w_b}: param") and "after step" in n
               for n in names)


def test_a_zero_checkpoint_of_a_model_with_a_frozen_parameter_resumes_under_a_plain_optimizer(gang):
    """speech_encdec keeps a frozen sinusoidal table (``requires_grad=False``): the zero optimizer, built
    over the trainable parameters, saved no entry for it, and a plain AdamW (over every parameter) refused
    the checkpoint ("holds no optimizer state for it"). The plain AdamW here is the one-device resume's;
    plan B shards its state (zero 3 at W=2)."""
    status, detail, checks, _ = _model(gang, "speech_encdec", "dp", 2, 1)
    assert status == MATCH, detail
    assert any(c["name"].startswith("resumed on one device: param") for c in checks)
    assert any(c["name"].startswith("resumed under dp zero3 at W=2: param") for c in checks)


def test_zero_2_with_micro_batches_accumulates_the_gradient_shards_exactly(gang):
    with tempfile.TemporaryDirectory() as tmp:  # train_step: no_sync, then one reduce-scatter of the sum, scaled
        job = {"kind": "model", "model": "nanogpt", "policy": "dp", "world_size": 2, "steps": 2, "seed": 0,
               "gen_dir": tmp, "recipe": {"zero": 2, "num_microbatches": 4}, "checkpoint": False}
        status, detail, _, _ = judge(gang.run(job, 2, 400))
    assert status == MATCH, detail


def test_zero_2_over_tp_replicas_trains_like_one_device(gang):
    status, detail, checks, _ = _model(gang, "nanogpt", "tp", 4, 2, plan_ngpus=2)
    assert status == MATCH, detail
    names = [c["name"] for c in checks]  # the replicas' checkpoint resumes too (into a zero plan B at W=4)
    other, w_b, zero_b = zero_plan_b("tp", 4, 2)
    assert any(n.startswith("resumed on one device: optimizer exp_avg_sq") for n in names)
    assert any(n.startswith(f"resumed under {other} zero{zero_b} at W={w_b}: param") and "after step" in n
               for n in names)


def test_a_zero_optimizer_holds_half_the_state_at_w2_and_loads_a_zero_0_checkpoint(tmp_path):
    answers = zero_ranks.run(str(tmp_path), "resume")
    for same, lr, mine, total in answers:  # each rank holds its half, and gathered they equal what was saved
        assert same and lr == 0.01 and mine == total // 2


def test_zero_redundancy_optimizer_by_hand_over_tp_shards_is_refused_naming_zero(tmp_path):
    for msg in zero_ranks.run(str(tmp_path), "hand_tp"):
        assert msg.startswith("ZeroError: ZeroRedundancyOptimizer over a parallelized module's parameters")
        assert "ComputeConfig(zero=1)" in msg and "\n" not in msg


def test_an_optimizer_by_hand_over_a_zero_2_module_is_refused_not_a_silent_no_op(tmp_path):
    for msg in zero_ranks.run(str(tmp_path), "hand_z2"):
        assert msg.startswith("ZeroError: AdamW over the parameters of a module compiled with zero=2 would step "
                              "nothing") and "module.build_optimizer(AdamW, ...)" in msg, msg


@pytest.mark.parametrize("zero", [2, 3])
def test_hand_clipping_over_gradient_shards_gets_the_whole_norm_and_a_subset_is_refused(tmp_path, zero):
    """zero 2/3 keep each gradient as slices of a shard: ``torch.nn.utils.clip_grad_norm_(pm.parameters())``
    used to find no ``.grad``, return 0 and clip nothing; it now equals ``pm.clip_grad_norm_`` (norm and
    clipped gradients), and a norm over some of the parameters is refused in one line."""
    for hand, builtin, same, subset in zero_ranks.run(str(tmp_path), f"hand_clip_z{zero}"):
        assert hand > 1e-2 and hand == builtin and same, (hand, builtin, same)  # clipped, like the built-in
        assert subset.startswith("ShardGradError: ") and f"zero={zero}" in subset and "\n" not in subset, subset
        assert "module.clip_grad_norm_(max_norm)" in subset, subset


def test_zero_redundancy_optimizer_by_hand_over_dp_copies_is_right(tmp_path):
    assert zero_ranks.run(str(tmp_path), "hand_dp") == [0.0, 0.0]


def test_rows_carry_memory_measured_per_rank_and_each_stage_shards_its_share_at_w4(gang):
    from verify.config import RunConfig
    from verify.rows.run import run_model
    mem = {}
    with tempfile.TemporaryDirectory() as tmp:
        for zero in (0, 1, 2, 3):
            (row,) = run_model(gang, "nanogpt", ("dp",), RunConfig(world_sizes=(4,), zero=zero), tmp, steps=1,
                               checkpoint=False)
            assert row.status == MATCH and row.partition == ("dp" if not zero else f"dp zero{zero}")
            assert len(row.memory) == 4 and set(row.memory[0]) == {"params", "grads", "optimizer", "activations"}
            assert row.to_json()["memory"] == row.memory
            mem[zero] = row.memory[0]
    assert mem[0]["activations"] > 0 and mem[1]["params"] >= mem[0]["params"]
    assert abs(mem[1]["optimizer"] / mem[0]["optimizer"] - 0.25) < 0.01  # AdamW's two moments, a quarter each
    assert mem[1]["grads"] == mem[0]["grads"] and abs(mem[2]["grads"] / mem[0]["grads"] - 0.25) < 0.01
    # zero 3: a quarter of the parameters too (its shards; the whole buckets are gathered only while used)
    pgo = {z: sum(mem[z][k] for k in ("params", "grads", "optimizer")) for z in mem}
    assert mem[3]["params"] / mem[0]["params"] < 0.26 and pgo[3] / pgo[0] <= 0.25 * 1.1


@pytest.mark.parametrize("bug, policy, replicas, says", [("zero_ungathered", "dp", 1, "param"),
                                                         ("zero_unscaled", "tp", 2, "grad")])
def test_a_wrong_zero_fails_its_case(bug, policy, replicas, says):
    from verify.config import RunConfig
    from verify.rows.replicas import run_replicas
    from verify.judge.verdict import MISMATCH
    from verify.runner.gang import Gang
    from verify.rows.run import run_model
    with Gang(4, (str(FIXTURES / f"{bug}.py"),), (4,)) as bad, tempfile.TemporaryDirectory() as tmp:
        cfg = RunConfig(world_sizes=(4,), zero=2)
        rows = list(run_replicas(bad, "nanogpt", (policy,), cfg, tmp, replicas, steps=1) if replicas > 1
                    else run_model(bad, "nanogpt", (policy,), cfg, tmp, steps=1, checkpoint=False))
    (row,) = rows
    assert row.status == MISMATCH and row.detail.startswith(says), row.detail
    assert "--zero 2" in row.rerun


def test_a_zero_optimizer_is_a_torch_optimizer_a_scheduler_drives():
    from nnscaler.runtime.zero import ZeroError, ZeroOptimizer, ZeroShards
    model = torch.nn.Linear(4, 3)
    shards = ZeroShards(list(model.parameters()), 1, None, [0], set(), {}, 2**20)  # a group of one rank
    opt = ZeroOptimizer(shards, torch.optim.AdamW, lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda step: 0.5 ** step)
    x = torch.randn(5, 4)
    for _ in range(3):
        for m, o, s in ((model, opt, sched), (ref, ref_opt, ref_sched)):
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
            s.step()
    assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups[0]["lr"] == 0.1 * 0.5 ** 3
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    with pytest.raises(ZeroError, match=r"^zero=1: LBFGS is not elementwise"):
        ZeroOptimizer(shards, torch.optim.LBFGS, lr=0.1)


@pytest.mark.parametrize("policy, world, zero, want", [("dp", 4, 1, ("hybrid", 4, 1)), ("dp", 2, 1, ("dp", 2, 3)),
                                                        ("dp", 2, 3, ("dp", 2, 1)), ("hybrid", 4, 2, ("dp", 2, 2)),
                                                        ("tp", 4, 2, ("hybrid", 4, 2))])
def test_a_zero_checkpoint_resumes_into_a_plan_that_shards_its_optimizer_state(policy, world, zero, want):
    from verify.cases.resume import zero_plan_b
    from verify.cases.zero import zero_applies
    got = zero_plan_b(policy, world, zero)
    assert got == want and zero_applies(got[0], got[1], zero=got[2])


def test_a_zero_resume_that_cuts_the_moments_at_wrong_offsets_fails():
    """The command a user runs for ZeRO (``--zero 1 --world-size 4``): the checkpoint resumes under hybrid
    with zero 1, so a sharded load that cuts the moments wrong is a MISMATCH naming the moment; the same
    case without the bug matches (the resume's own checks included)."""
    from verify.config import RunConfig
    from verify.judge.verdict import MISMATCH
    from verify.runner.gang import Gang
    from verify.rows.run import run_model
    cfg = RunConfig(world_sizes=(4,), zero=1)
    with tempfile.TemporaryDirectory() as tmp:
        with Gang(4, (str(FIXTURES / "zero_load_offset.py"),), (4,)) as bad:
            (row,) = run_model(bad, "nanogpt", ("dp",), cfg, tmp, steps=1)
        with Gang(4, (), (4,)) as good:
            (ok,) = run_model(good, "nanogpt", ("dp",), cfg, tmp, steps=1)
    assert row.status == MISMATCH and "resumed under hybrid zero1 at W=4: optimizer exp_avg" in row.detail, row.detail
    assert ok.status == MATCH, ok.detail
