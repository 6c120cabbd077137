"""Micro-batches and gradient accumulation without a pipeline: splitting, loss weighting (exact for
means over a varying number of elements), ``no_sync`` and ``train_step`` on real ranks."""
from __future__ import annotations

import tempfile
from pathlib import Path
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from nnscaler.policies import ComputeConfig, PlanError
from nnscaler.runtime.microbatch import MicroBatchError, accumulate, check_divisible, loss_terms, split_batch
from verify.judge.verdict import MATCH, MISMATCH, judge
from verify.models.registry import MODELS
from verify.kinds.model import Model


# -- on one process: splitting and the weighting of losses -------------------------------------------
def test_split_batch_splits_every_batched_tensor_and_passes_the_rest():
    x, y, scale = torch.arange(12.).reshape(6, 2), torch.arange(6), torch.tensor(2.0)
    pieces = split_batch((x, y, scale, "opt"), {"w": torch.ones(6, 1)}, 3)
    assert len(pieces) == 3
    assert torch.equal(torch.cat([a[0] for a, _ in pieces]), x) and all(a[2] is scale and a[3] == "opt" for a, _ in pieces)
    assert [k["w"].shape[0] for _, k in pieces] == [2, 2, 2]


def test_bad_micro_batch_configs_are_one_line_errors():
    with pytest.raises(MicroBatchError, match=r"argument 1 has 5 rows .*num_microbatches=2"):
        check_divisible((torch.ones(4, 3), torch.ones(5)), {}, 2)
    with pytest.raises(MicroBatchError, match="no tensor with a dim 0"):
        split_batch((3, torch.tensor(1.0)), {}, 2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(PlanError, match="num_microbatches must be a positive integer"):
            ComputeConfig(2, num_microbatches=bad)
    with pytest.raises(MicroBatchError, match="scalar floating loss"):
        loss_terms(torch.ones(3), 4)
    from nnscaler import parallelize  # refused before any process group or trace
    with pytest.raises(PlanError, match=r"sample_args: batch argument 0 has 6 rows .*num_microbatches=4"):
        parallelize(torch.nn.Linear(3, 3), (torch.ones(6, 3),), "dp", ComputeConfig(2, num_microbatches=4))


class _TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(11, 6), torch.nn.Linear(6, 11)

    def forward(self, idx, tgt):  # the logits; the loss is the loss_fn's
        return self.head(self.emb(idx))


def _padded_lm(seed: int, rows: int, m: int):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = _TinyLM()
    idx = torch.randint(0, 11, (rows, 5), generator=g)
    tgt = torch.randint(0, 11, (rows, 5), generator=g)
    keep = torch.randint(0, 6, (rows,), generator=g)  # each row keeps 0..5 real targets: uneven micro-batches
    tgt[torch.arange(5)[None, :] >= keep[:, None]] = -100
    tgt[0, 0] = 3  # at least one real target in the batch
    return model, idx, tgt


def _loss(out, idx, tgt):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), m=st.sampled_from([1, 2, 3, 4]))
def test_accumulation_of_uneven_means_equals_the_whole_batch(seed, m):
    """(loss_sum, count) micro-batches give the whole batch's loss and gradient exactly; the mean of
    the micro-batch means (loss scaled per micro-batch) does not, whenever the counts differ."""
    model, idx, tgt = _padded_lm(seed, 4 * m, m)
    whole = _loss(model(idx, tgt), idx, tgt)
    want = torch.autograd.grad(whole, list(model.parameters()))

    def weighted(out, idx, tgt):
        count = (tgt != -100).sum()
        return (_loss(out, idx, tgt) * count if count else out.sum() * 0.0), count

    got_loss = accumulate(model, (idx, tgt), {}, m, weighted, model.parameters(), nullcontext)
    assert torch.allclose(got_loss, whole.detach(), rtol=1e-5, atol=1e-6)
    for p, w in zip(model.parameters(), want):
        assert torch.allclose(p.grad, w, rtol=1e-4, atol=1e-6)
    counts = [int((t != -100).sum()) for (_, t), _ in split_batch((idx, tgt), {}, m)]
    if len(set(counts)) > 1 and min(counts) > 0:  # per-micro-batch scaling is wrong here, and the test sees it
        model.zero_grad()
        accumulate(model, (idx, tgt), {}, m, _loss, model.parameters(), nullcontext)
        assert not all(torch.allclose(p.grad, w, rtol=1e-4, atol=1e-6) for p, w in zip(model.parameters(), want))


def test_train_step_adds_to_gradients_held_before_and_restores_them_on_error():
    model, idx, tgt = _padded_lm(0, 4, 2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    weighted = (lambda out, idx, tgt: (_loss(out, idx, tgt) * (tgt != -100).sum(), (tgt != -100).sum()))
    accumulate(model, (idx, tgt), {}, 2, weighted, model.parameters(), nullcontext)
    fresh, _, _ = _padded_lm(0, 4, 2)
    g = torch.autograd.grad(_loss(fresh(idx, tgt), idx, tgt), list(fresh.parameters()))
    assert all(torch.allclose(p.grad, 1 + w, atol=1e-6) for p, w in zip(model.parameters(), g))
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(MicroBatchError):
        accumulate(model, (idx, tgt), {}, 2, lambda out, *a: out, model.parameters(), nullcontext)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))


# -- on real ranks ------------------------------------------------------------------------------------
CATALOG = str(Path(__file__).parents[1] / "mutants" / "catalog")  # a package, loaded by path in the ranks


def _accumulation(gang, name, policy, mode, world_size=2, plan_ngpus=None, m=2, seed=0, mutant=None):
    with tempfile.TemporaryDirectory() as tmp:
        job = {"kind": "accumulation", "model": name, "policy": policy, "mode": mode, "microbatches": m,
               "world_size": world_size, "plan_ngpus": plan_ngpus or world_size, "seed": seed, "gen_dir": tmp,
               "mutant": mutant, "catalog": CATALOG}
        return judge(gang.run(job, world_size, 240))


@pytest.mark.parametrize("policy,world_size,plan_ngpus", [("tp", 2, 2), ("dp", 4, 2)])
def test_two_backwards_equal_one_batch_with_or_without_no_sync(gang, policy, world_size, plan_ngpus):
    """The user's loop: backward of two micro-batches' losses, then the gradient of the whole batch.
    With ``no_sync`` around the first it matches one device (in-plan sums and replica averages); so
    does the loop written for one device, each backward synced (the second sum must not count the
    first one's result again: it did, silently, before the sync divided it back)."""
    for mode in ("no_sync", "synced"):
        status, detail, checks, _ = _accumulation(gang, "weightnorm_mlp", policy, mode, world_size, plan_ngpus)
        assert status == MATCH, (mode, detail)
        assert sum(c["name"].startswith("grad") for c in checks) >= 5


@pytest.mark.parametrize("policy,world_size,plan_ngpus,seed", [("dp", 2, 2, 0), ("dp", 2, 2, 1), ("tp", 4, 2, 0)])
def test_train_step_on_padded_targets_equals_one_device_on_the_whole_batch(gang, policy, world_size, plan_ngpus, seed):
    """Four uneven micro-batches (padded targets), within a plan and across two replicas, across seeds."""
    status, detail, checks, _ = _accumulation(gang, "padded_gpt", policy, "train_step", world_size, plan_ngpus, m=4,
                                              seed=seed)
    assert status == MATCH, detail
    assert checks[0]["name"] == "loss" and sum(c["name"].startswith("grad") for c in checks) >= 10


@pytest.mark.parametrize("mutant,name,policy,world_size,plan_ngpus", [
    ("grad_sync_before_the_last_micro_batch", "weightnorm_mlp", "tp", 2, 2),
    ("grad_sync_before_the_last_micro_batch", "weightnorm_mlp", "dp", 4, 2),
    ("loss_scaled_per_micro_batch", "padded_gpt", "dp", 2, 2)])
def test_accumulation_bugs_are_caught(gang, mutant, name, policy, world_size, plan_ngpus):
    """A gradient reducer launched before the last micro-batch, and a loss scaled per micro-batch, each
    put into the runtime for this case only (the same case passes without them, above)."""
    status, detail, checks, _ = _accumulation(gang, name, policy, "train_step", world_size, plan_ngpus, m=4,
                                              mutant=mutant)
    assert status == MISMATCH, detail
    assert any(not c["ok"] for c in checks)
    status, detail, _, _ = _accumulation(gang, name, policy, "train_step", world_size, plan_ngpus, m=4)
    assert status == MATCH, detail  # and the gang's runtime is clean again


# -- the harness: whole-model rows with micro-batches ------------------------------------------------
def test_a_padded_gpt_row_with_four_micro_batches_matches_one_device(gang):
    from verify.config import RunConfig
    from verify.rows.run import run_model
    cfg = RunConfig(world_sizes=(2,), microbatches=4)
    with tempfile.TemporaryDirectory() as tmp:
        (row,) = run_model(gang, "padded_gpt", ("dp",), cfg, tmp, steps=2)
    assert (row.status, row.detail) == (MATCH, "")
    assert row.partition == "dp mb4" and row.microbatches == 4 and "4 micro-batches" in row.annotation
    assert row.to_json()["microbatches"] == 4
    assert "--microbatches 4" in Model.rerun_command(cfg, "padded_gpt", "dp", 2, 0, 2)
    assert "--microbatches" not in Model.rerun_command(RunConfig(), "padded_gpt", "dp", 2, 0, 2)


def test_the_cli_takes_micro_batches_and_refuses_bad_counts(capsys):
    from verify.cli import build_parser, main
    assert build_parser().parse_args(["model", "nanogpt", "--microbatches", "4"]).microbatches == 4
    assert build_parser().parse_args(["model", "nanogpt"]).microbatches == 1
    assert build_parser().parse_args(["all"]).microbatches == [4]
    assert build_parser().parse_args(["all", "--microbatches"]).microbatches == []
    for bad in ("0", "-2", "x"):
        assert main(["model", "nanogpt", "--microbatches", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--microbatches" in err


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["dp", "tp"])
@pytest.mark.parametrize("name", sorted(n for n, b in MODELS.items() if b.__module__.startswith("verify.models")))
def test_every_model_trains_with_four_micro_batches_like_one_device(verify_model, name, policy):
    """The micro-batch sweep of ``verify all``: M=4 under dp and tp at W=2 and 4, every built-in model."""
    rows = verify_model(name, policies=[policy], world_sizes=[2, 4], steps=3, microbatches=4)
    assert [(r.world_size, r.partition) for r in rows] == [(2, f"{policy} mb4"), (4, f"{policy} mb4")]


def test_a_loss_that_couples_the_batch_is_judged_against_the_same_micro_batches_on_one_device(gang):
    # clip_tiny's contrastive loss couples every pair of a batch: 4 micro-batches of it are 4 losses,
    # not the loss of the whole batch; the reference runs the same 4 micro-batches on one device
    from verify.config import RunConfig
    from verify.cases.microbatch import one_device_loss, whole_batch
    from verify.models.registry import MODELS
    from verify.rows.run import run_model
    case = MODELS["clip_tiny"](0)
    args = whole_batch(case.batch, 0, 4)
    with torch.no_grad():
        assert abs(float(one_device_loss(case.model, args, 4, case)) - float(case.model(*args))) > 0.1
        mean = sum(case.model(*case.batch(i)) for i in range(4)) / 4
        assert torch.allclose(one_device_loss(case.model, args, 4, case), mean)
    with tempfile.TemporaryDirectory() as tmp:
        (row,) = run_model(gang, "clip_tiny", ("dp",), RunConfig(world_sizes=(2,), microbatches=4), tmp, steps=2,
                           checkpoint=False)
    assert (row.status, row.detail) == (MATCH, "")
