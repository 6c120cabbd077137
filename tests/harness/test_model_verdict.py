"""The whole-model verdict: no fail-open checks, no false alarms on correct programs, and single-rank
perturbations of 1e-4 relative (an activation, a gradient bucket, a parameter shard, an optimizer
step) are caught; ``--dtype`` really runs that dtype; gradients really span several buckets."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nnscaler.runtime.grad_sync import GradSync
from verify.judge.verdict import MATCH, MISMATCH, judge
from verify.config import RunConfig
from verify.rows.run import run_model
from verify.judge.compare import Float64Fallback, check_tensor, check_update
from verify.runner.gang import Gang
from verify.judge.answer import RankAnswer
from verify.cases.step_checks import LR, own_state, with_aliases
from verify.models.loader import build_model
from verify.runner.worker import load_modules

PERTURBED = str(Path(__file__).parents[1] / "fixtures" / "perturbed.py")


# -- fail-open spots, one by one ---------------------------------------------------------------------
def test_none_passes_only_where_the_float64_reference_has_none_too():
    t = torch.ones(3)
    assert check_tensor("g", None, None, None).ok
    assert not check_tensor("g", None, None, t.double()).ok  # both lost a gradient the reference has
    assert not check_tensor("g", None, t, t.double()).ok
    assert not check_tensor("g", t, None, t.double()).ok
    assert not check_update("p", None, t, LR).ok


def _answer(rank: int, names: list[str]) -> RankAnswer:
    return RankAnswer(rank, {"checks": [{"name": n, "err": 0.0, "tol": 1.0, "ok": True, "reason": ""} for n in names]})


def test_an_empty_or_short_list_of_checks_fails():
    full = ["loss step 0", "grad w step 0"]
    assert judge([_answer(0, full), _answer(1, full)], full)[0] == MATCH
    assert judge([_answer(0, full), _answer(1, [])])[0] == MISMATCH
    status, detail, _, _ = judge([_answer(0, full), _answer(1, full[:1])], full)
    assert status == MISMATCH and "rank 1" in detail and "grad w step 0" in detail


def test_the_reload_check_is_the_first_plan_that_fits_or_a_note_saying_why_none_does():
    """A tp checkpoint at W=3 cannot reload under dp (a batch of 4 over 3 ranks): the next plan serves,
    and where none fits the row matches and says why; a rank that returns no reload check still fails."""
    from verify.cases.model import NO_RELOAD_PLAN, expected_checks, reload_policies
    assert reload_policies("tp") == ["dp", "hybrid", "random"] and reload_policies("dp")[0] == "tp"
    expected = expected_checks("nanogpt", "tp", 1, 0)
    base = [n for n in expected if isinstance(n, str)]
    for reload in ("loss of the checkpoint under dp", "loss of the checkpoint under hybrid"):
        assert judge([_answer(0, base + [reload])], expected)[:2] == (MATCH, "")
    status, detail, _, _ = judge([_answer(0, base)], expected)
    assert status == MISMATCH and "lacks 1: loss of the checkpoint under dp" in detail
    note = RankAnswer(0, {"checks": [*_answer(0, base).result["checks"],
                                            {"name": NO_RELOAD_PLAN, "err": 0.0, "tol": 0.0, "ok": True,
                                             "reason": "dp: batch 4 does not divide over 3 ranks"}]})
    assert judge([note], expected)[:2] == (MATCH, "no other plan reloads the checkpoint: dp: batch 4 does not "
                                                   "divide over 3 ranks")


def test_tied_weights_go_by_their_first_name_and_reload_strictly():
    model = build_model("gpt2_v96", 0).model
    state = own_state(model)
    assert "model.lm_head.weight" not in state and "model.transformer.wte.weight" in state
    full = with_aliases(model, state)
    assert set(full) == set(model.state_dict())
    model.load_state_dict(full, strict=True)
    del state["model.transformer.h.0.attn.c_attn.weight"]
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict(with_aliases(model, state), strict=True)


# -- the update bound follows from rounding: AdamW on a shard equals AdamW on the whole ---------------
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-6, 1e-2, 1.0, 1e3]), parts=st.sampled_from([2, 4]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_adamw_on_shards_meets_the_update_bound_and_a_nudge_does_not(seed, scale, parts, dtype):
    g = torch.Generator().manual_seed(seed)
    whole = torch.randn(8, 12, generator=g).to(dtype)
    grads = [(torch.randn(8, 12, generator=g) * scale).to(dtype) for _ in range(3)]
    grads[1][0, 0] = 0  # a vanishing gradient: Adam's update there is pure rounding noise of zero
    shards = [p.clone() for p in whole.chunk(parts)]
    want = whole.clone()
    opt_whole, opt_shards = torch.optim.AdamW([want], lr=LR), torch.optim.AdamW(shards, lr=LR)
    for grad in grads:
        want.grad = grad.clone()
        for s, gs in zip(shards, grad.chunk(parts)):
            s.grad = gs.clone()
        opt_whole.step()
        opt_shards.step()
        got = torch.cat(shards)
        assert check_update("p", got, want, LR).ok
    nudged = got.clone()
    nudged[: 8 // parts] *= 1 + 1e-4 if dtype != torch.bfloat16 else 1 + 1e-1
    assert not check_update("p", nudged, want, LR).ok


def test_a_gradient_off_by_a_constant_factor_fails_though_adam_would_hide_it():
    g64 = torch.randn(5, 5, dtype=torch.float64)
    dev = g64.float()
    assert check_tensor("grad", dev, dev, g64, scale=1.0).ok
    assert not check_tensor("grad", dev * (1 + 1e-4), dev, g64, scale=float(g64.abs().max())).ok


# -- float64 fallback --------------------------------------------------------------------------------
@torch.library.custom_op("nnscaler_test::no_float64", mutates_args=())
def no_float64(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float64:
        raise RuntimeError("no_float64 not implemented for 'Double'")
    return x.sin()


no_float64.register_fake(lambda x: torch.empty_like(x))


def test_an_operator_without_float64_kernel_falls_back_to_the_test_dtype_and_is_named():
    x = torch.randn(6, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="Double"):
        no_float64(x)
    mode = Float64Fallback(torch.float32)
    with mode:
        y = no_float64(x) * 2 + x.cos()  # the rest stays float64
    assert y.dtype == torch.float64 and mode.used == {"nnscaler_test.no_float64.default"}
    assert torch.equal(y, no_float64(x.float()).double() * 2 + x.cos())


# -- buckets ------------------------------------------------------------------------------------------
def test_a_small_bucket_size_spreads_the_gradients_over_several_buckets():
    model = build_model("bucketed_mlp", 0)
    pairs = [(p, "dp-group") for p in model.model.parameters()]
    assert len(GradSync.build(pairs).buckets) == 1
    buckets = GradSync.build(pairs, model.bucket_bytes).buckets
    assert len(buckets) > 8 and sum(len(b.params) for b in buckets) == len(pairs)


# -- whole models on real ranks -----------------------------------------------------------------------
@pytest.mark.parametrize("name,policy,world", [("nanogpt@128", "tp", 2), ("transformer_encoder@256", "dp", 2),
                                               ("bucketed_mlp", "dp", 4), ("weightnorm_mlp", "tp", 4),
                                               ("padded_gpt", "dp", 4), ("gpt2_v96", "tp", 2), ("vit@128", "tp", 2),
                                               ("conv1d_net@32", "dp", 4)])
def test_correct_programs_match_across_widths_and_seeds(verify_model, name, policy, world):
    if name.startswith(("gpt2", "vit")) and not _has_transformers():
        pytest.skip("needs transformers")
    rows = verify_model(name, policies=[policy], world_sizes=[world], seeds=[3], steps=3)
    assert [(r.status, r.detail) for r in rows] == [(MATCH, "")]


@pytest.mark.parametrize("dtype,worst", [("float64", 1e-12), ("bfloat16", None)])
def test_dtype_is_really_run(gang, dtype, worst):
    with tempfile.TemporaryDirectory() as tmp:
        (row,) = run_model(gang, "nanogpt", ("tp",), RunConfig(world_sizes=(2,), dtype=dtype), tmp, steps=2)
    assert row.status == MATCH, row.detail
    if worst is not None:
        assert row.grad_err < worst and row.out_err < worst  # float32 would round at 1e-7
    else:
        assert row.out_tol > 1e-3  # a bfloat16 floor, 16 eps = 0.125 of the largest value


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def perturbed_gang(registry):
    load_modules((PERTURBED,))  # the parent lists the checks every rank must return, from the model
    with Gang(2, (PERTURBED,), (2,)) as g:
        yield g


@pytest.mark.parametrize("name,policy,first", [("nudged_activation", "dp", ("loss step 0", "grad")),
                                               ("nudged_bucket", "dp", ("grad",)),
                                               ("nudged_shard", "tp", ("load step 0",)),  # the load check sees it first
                                               ("nudged_step", "tp", ("param fc1.weight after step 0",)),
                                               ("dropped_param", "dp", ("initial nudge_dropped_param",))])
def test_a_single_rank_perturbation_of_1e_4_is_caught(perturbed_gang, name, policy, first):
    with tempfile.TemporaryDirectory() as tmp:
        (row,) = run_model(perturbed_gang, name, (policy,), RunConfig(world_sizes=(2,), modules=(PERTURBED,)), tmp,
                           steps=2)
    assert row.status == MISMATCH and row.detail.startswith(first), row.detail
