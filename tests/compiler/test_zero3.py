"""ZeRO 3 (``ComputeConfig(zero=3)``): parameters sharded over the data-parallel ranks, each block's
bucket gathered when read and freed after, gathered again in backward; training equals one device
under dp, hybrid and tp replicas (with clipping, recompute and bf16-mixed too), checkpoints resume
across zero stages, plans and world sizes, and a wrong re-gather is caught."""
from __future__ import annotations

import gc
import sys
import tempfile
import weakref
from pathlib import Path

import pytest
import torch

from verify.cases.resume import zero_plan_b
from verify.judge.verdict import MATCH, MISMATCH, judge

FIXTURES = Path(__file__).parents[1] / "fixtures"
sys.path.insert(0, str(FIXTURES))
import zero3_ranks  # noqa: E402


def _model(gang, policy, world_size, zero=3, name="nanogpt", plan_ngpus=None, **recipe):
    with tempfile.TemporaryDirectory() as tmp:
        job = {"kind": "model", "model": name, "policy": policy, "world_size": world_size, "steps": 2, "seed": 0,
               "gen_dir": tmp, "recipe": {"zero": zero, **recipe}}
        if plan_ngpus:
            job["plan_ngpus"] = plan_ngpus
        return judge(gang.run(job, world_size, 600))


def _toy(n_blocks=4, width=8):
    torch.manual_seed(0)
    return {f"l.{i}.w": torch.nn.Parameter(torch.randn(width, width) / width ** 0.5) for i in range(n_blocks)}


def _program(p, x):
    for i in range(4):
        x = torch.tanh(x @ p[f"l.{i}.w"])
    return x.square().sum()


def test_zero_3_gathers_a_block_on_use_frees_it_after_and_gathers_it_again_in_backward():
    from nnscaler.runtime.zero import ZeroShards
    from nnscaler.runtime.zero3 import KEEP, GatheredParams, saved_hooks
    ref = _toy()
    params = {n: torch.nn.Parameter(t.detach().clone()) for n, t in ref.items()}
    shards = ZeroShards(list(params.values()), 3, None, [0], {}, {}, 2**20,  # a zero group of one rank
                        {id(p): n.rsplit(".", 1)[0] for n, p in params.items()})
    assert len(shards.buckets) == 4 and all(p.untyped_storage().nbytes() == 0 for p in params.values())
    live, alive_at_gather = [], []
    gathered = shards.gathered

    def tracked(b):
        alive_at_gather.append(sum(r() is not None for r in live))
        out = gathered(b)
        live.append(weakref.ref(out))
        return out

    shards.gathered = tracked
    where = {n: (b, i) for b in shards.buckets for i, p in enumerate(b.params) for n in params if params[n] is p}
    x = torch.randn(3, 8, requires_grad=True)  # so that every block's matmul saves its weight
    mapping = GatheredParams(shards, dict(params), where)
    with saved_hooks(shards):
        loss = _program(mapping, x)
    mapping.close()
    gc.collect()
    forward = len(live)
    assert forward == 4 and max(alive_at_gather) <= KEEP  # one gather per block; at most KEEP held before the next
    assert all(r() is None for r in live)  # nothing gathered outlives the forward: autograd kept positions only
    loss.backward()
    assert len(live) - forward == 4  # each block gathered again for the tensors its matmul saved
    _program(ref, x).backward()
    for b in shards.buckets:
        (name,) = [n for n, p in params.items() if p is b.params[0]]
        torch.testing.assert_close(b.shard.grad[:ref[name].numel()], ref[name].grad.reshape(-1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("policy, world_size", [("dp", 2), pytest.param("dp", 4, marks=pytest.mark.slow),
                                                ("hybrid", 4)])
def test_zero_3_trains_like_one_device_and_resumes_under_another_plan(gang, policy, world_size):
    status, detail, checks, _ = _model(gang, policy, world_size)
    assert status == MATCH, detail
    names = [c["name"] for c in checks]
    other, w_b, zero_b = zero_plan_b(policy, world_size, 3)  # plan B shards its optimizer state too
    assert any(n.startswith("resumed on one device: optimizer exp_avg") for n in names)
    assert any(n.startswith(f"resumed under {other} zero{zero_b} at W={w_b}: optimizer exp_avg") for n in names)
    assert any(n.startswith(f"resumed under {other} zero{zero_b} at W={w_b}: param") and "after step" in n
               for n in names)


def test_zero_3_over_tp_replicas_with_clipping_and_recompute_trains_like_one_device(gang):
    # a norm's weight is summed over the tp axis, then reduce-scattered over the replicas; each step clipped
    # (one device clips with torch) and judged by the parameters after it
    status, detail, checks, _ = _model(gang, "tp", 4, plan_ngpus=2, clip_grad_norm=0.5, recompute="full")
    assert status == MATCH, detail
    assert any(c["name"].startswith("param") and "after step 1" in c["name"] for c in checks)


@pytest.mark.parametrize("zero, policy, world_size", [(2, "dp", 2), (3, "hybrid", 4)])
def test_clipping_the_reduce_scattered_gradient_shards_equals_one_device(gang, zero, policy, world_size):
    # max norm 0.5, below nanoGPT's gradient norm (1.17 at step 0): clipped by the norm one device gets
    status, detail, checks, _ = _model(gang, policy, world_size, zero=zero, clip_grad_norm=0.5)
    assert status == MATCH, detail
    norms = [c for c in checks if c["name"].startswith("grad norm step")]
    assert len(norms) == 2 and all(c["ok"] for c in norms)


@pytest.mark.slow
def test_zero_3_recipe_combination_on_llama_matches(gang):
    status, detail, _, _ = _model(gang, "dp", 4, name="llama", precision="bf16-mixed", recompute="full",
                                  clip_grad_norm=1.0)
    assert status == MATCH, detail


def test_a_wrong_zero_3_regather_fails_its_case():
    from verify.config import RunConfig
    from verify.runner.gang import Gang
    from verify.rows.run import run_model
    with Gang(2, (str(FIXTURES / "zero3_wrong_regather.py"),), (2,)) as bad, tempfile.TemporaryDirectory() as tmp:
        (row,) = run_model(bad, "nanogpt", ("dp",), RunConfig(world_sizes=(2,), zero=3), tmp, steps=1, checkpoint=False)
    assert row.status == MISMATCH and row.detail.startswith("grad"), row.detail  # the loss is right: forward gathers right
    assert "--zero 3" in row.rerun


@pytest.mark.slow
def test_zero_3_at_w4_resumes_under_zero_1_at_w2_then_on_one_device(tmp_path):
    answers = zero3_ranks.run(str(tmp_path))
    for a in answers[:2]:
        assert "error" not in a, a
        assert a["w2 loads"] and a["one device loads"]
        assert a["w2 steps"] < 1e-4  # the W=4 zero 3 run's next step (an update is lr = 1e-2)
    assert all(not a for a in answers[2:])


def test_verify_all_samples_the_combined_recipe_on_nanogpt_and_llama_only_when_it_runs_none_itself():
    from nnscaler.recipe import Recipe
    from verify.sweep.selection import RECIPE, default_units, full_units
    units = [u for u in full_units([], ("bert", "llama", "nanogpt"), ["dp"], (2, 4), (0,), (0,), [], [], True)
             if u.recipe]
    assert {(u.name, u.policy, u.replicas, u.world_sizes) for u in units} == {
        (m, p, r, w) for m in ("bert", "nanogpt", "llama") for p, r, w in  # --full: on every model
        (("dp", 1, (2,)), ("dp", 1, (4,)), ("hybrid", 1, (4,)), ("tp", 2, (4,)), ("pp2_dp", 1, (4,)))}  # 3 pipeline models
    assert all(u.label.endswith("bf16-mixed zero3 clip1 recompute=full W=" + str(u.world_sizes[0]) + " seed 0"
                                + ("" if u.checkpoint else " no-resume")) for u in units)
    assert RECIPE == Recipe(precision="bf16-mixed", zero=3, recompute="full", clip_grad_norm=1.0)
    assert not [u for u in full_units([], ("nanogpt",), ["dp"], (2, 4), (0,), (0,), [], [], False) if u.recipe]
    sample = default_units(units, ("llama", "nanogpt"), ["dp"], (2, 4), (0,))
    assert {(u.policy, u.replicas, u.world_sizes) for u in sample} == {  # each kind of recipe unit once
        ("dp", 1, (2,)), ("dp", 1, (4,)), ("hybrid", 1, (4,)), ("tp", 2, (4,)), ("pp2_dp", 1, (4,))}


@pytest.mark.parametrize("zero", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_experts_split_along_the_dp_axis_are_sharded_over_the_replicas_only(gang, zero):
    # mixtral_ep under dp splits its experts along the dp axis: the dp ranks hold different experts, so
    # they are no zero group for them (zero 1 there was wrong: each rank's slice mixed two ranks' experts)
    status, detail, _, _ = _model(gang, "dp", 2, zero=zero, name="mixtral_ep")
    assert status == MATCH, detail


@pytest.mark.slow
def test_the_recipes_combined_over_tp_replicas_match(gang):
    status, detail, _, _ = _model(gang, "tp", 4, plan_ngpus=2, precision="bf16-mixed", recompute="full",
                                  clip_grad_norm=1.0)
    assert status == MATCH, detail
