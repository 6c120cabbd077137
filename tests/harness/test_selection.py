"""verify all's units: the default sample covers every model under every policy and each expensive
axis at least once, is a subset of the whole matrix (--full), and comes first in --full's order;
--shard cuts deterministic, disjoint, time-balanced shares; merge refuses shards that do not fit."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from nnscaler.policies import POLICIES
from verify.cases.pipeline import PIPELINE_MODELS, SWEPT
from verify.rows.torchpar_builtin import CASES as TORCH_CASES
from verify.models.registry import MODELS
from verify.names import TWO_D_RESUME
from verify.runner.limits import max_ranks
from verify.sweep.selection import (BLOCKED_MODELS, DEFAULT_PLANS, NO_RESUME_STEPS, PLANS, RECIPE_MODELS, SEEDED_POLICIES,
                              Unit, _same, default_units, full_order, full_units, plan_units, saved_plans, wide_plan_units)
from verify.sweep.shard import ShardError, assign, check_shards, estimate, fingerprint, parse_shard, recorded_times, shard

# the built-in models and policies (the test fixtures register more: tp_* models, tp_sp policies)
MODEL_NAMES = sorted(m for m, build in MODELS.items() if build.__module__.startswith("verify.models")
                     and not m.startswith("tp_"))
POLICIES = [p for p in POLICIES if p in ("dp", "tp", "hybrid", "random", "random2d", "autodist")]
RANDOM_SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def matrix():
    full = full_units(["relu", "linear"], MODEL_NAMES, list(POLICIES), (2, 4), (0,), RANDOM_SEEDS, [4], TORCH_CASES,
                      True, plans=saved_plans())
    return full, default_units(full, MODEL_NAMES, list(POLICIES), (2, 4), RANDOM_SEEDS)


def test_the_default_sample_is_part_of_the_whole_matrix_and_far_smaller(matrix):
    full, default = matrix
    keys = {_same(u) for u in full}
    assert all(_same(u) in keys for u in default)
    assert len(default) < len(full) / 3
    assert len({_same(u) for u in default}) == len(default)  # no unit twice


def test_every_model_runs_under_every_policy_and_every_operator_and_torch_case_runs(matrix):
    _, default = matrix
    plain = {(u.name, u.policy) for u in default if u.kind == "model" and u.microbatches == 1 and u.replicas == 1
             and not u.recipe}
    assert plain == {(m, p) for m in MODEL_NAMES for p in POLICIES}
    assert {u.name for u in default if u.kind == "op"} == {"relu", "linear"}
    assert {(u.name, u.world_sizes) for u in default if u.kind == "torchpar"} == \
        {(c.name, (c.world_size,)) for c in TORCH_CASES}


def test_each_expensive_axis_is_exercised_at_least_once(matrix):
    _, default = matrix
    models = [u for u in default if u.kind == "model"]
    plain = [u for u in models if u.microbatches == 1 and u.replicas == 1 and not u.recipe]
    for p in POLICIES:  # each policy at each world size, and resumed from a checkpoint at each
        assert {u.world_sizes for u in plain if u.policy == p} == {(2,), (4,)}, p
        assert {u.world_sizes for u in plain if u.policy == p and u.checkpoint} == {(2,), (4,)}, p
    assert {m for m in MODEL_NAMES} == {u.name for u in plain if u.checkpoint}  # each model resumes once
    for p in SEEDED_POLICIES:  # each random seed draws plans somewhere
        if p in POLICIES:
            assert {u.seeds for u in plain if u.policy == p} == {(s,) for s in RANDOM_SEEDS}
    assert {u.policy for u in models if u.microbatches > 1 and u.policy not in SWEPT} == {"dp", "tp"}
    assert {u.name for u in models if u.microbatches > 1 and u.policy not in SWEPT} == set(MODEL_NAMES)
    assert {u.policy for u in models if u.policy in SWEPT and u.replicas == 1} == set(SWEPT)
    assert {u.name for u in models if u.policy in SWEPT} <= set(PIPELINE_MODELS)
    assert {u.policy for u in models if u.replicas > 1 and not u.recipe} == {"tp", "pp"}
    assert {(u.policy, u.replicas, u.world_sizes) for u in models if u.recipe} == \
        {("dp", 1, (2,)), ("dp", 1, (4,)), ("hybrid", 1, (4,)), ("tp", 2, (4,)), ("pp2_dp", 1, (4,))}


def test_no_resume_units_train_two_steps_and_are_the_first_steps_of_the_full_units(matrix):
    """The default's no-resume model units train NO_RESUME_STEPS; its resumes and the whole matrix 3;
    --full runs each default unit as the matrix has it, so it trains the same first steps."""
    full, default = matrix
    models = [u for u in default if u.kind == "model"]
    assert {u.steps for u in models if u.checkpoint} == {3}
    assert {u.steps for u in models if not u.checkpoint and u.replicas == 1 and not u.recipe
            and not u.name.startswith("zoo:")} == {NO_RESUME_STEPS} == {2}
    assert {u.steps for u in full} == {3}
    order = full_order(full, default)
    assert [_same(u) for u in order[:len(default)]] == [_same(u) for u in default]
    assert all(u.steps == 3 for u in order)


def test_a_piece_split_in_blocks_is_resumed_on_a_2x2_mesh_under_each_2d_resume(matrix):
    """The 2-D resumes (dp -> hybrid, tp -> random2d at W=4) include a fused-projection model each:
    a load cutting a blocked piece by the other mesh axis's coordinate is caught by the default."""
    _, default = matrix
    for p in TWO_D_RESUME:
        assert any(u.policy == p and u.world_sizes == (4,) and u.checkpoint and u.name in BLOCKED_MODELS
                   for u in default), p


def test_every_saved_plan_runs_under_full_and_one_cheap_one_by_default(matrix):
    full, default = matrix
    plans = saved_plans()
    assert plans, "verify/plans holds the plans bench/calibration/autodist.py prints (--save verify/plans)"
    units = [u for u in full if u.kind == "plan"]
    from verify.plan.cli import load
    from verify.models.saved_plan import reduce_parallel
    world = {p: reduce_parallel(load(p).parallel).world for p in plans}
    small = {p for p in plans if world[p] <= 4}
    wide = {p for p in plans if world[p] == 8}  # tp x pp x dp all > 1: on a gang of 8 of their own
    assert small and wide and small | wide == set(plans)
    named = {u.name for u in units}
    assert named == {f"verify/plans/{p.name}" for p in (small | wide if max_ranks() >= 8 else small)}
    assert all(u.world_sizes[0] in (2, 4, 8) and u.seeds == (0,) for u in units)
    assert all(u.world_sizes == (world[PLANS / Path(u.name).name],) for u in units)
    assert not any(u.kind == "plan" and u.world_sizes == (8,) for u in default)  # ~75-220 s each: --full only
    assert {u.name.split("/")[-1][:-5] for u in default if u.kind == "plan"} == set(DEFAULT_PLANS)
    assert next(u for u in units if DEFAULT_PLANS[0] in u.name).label == f"plan:{DEFAULT_PLANS[0]} W=2 seed 0"
    assert plan_units(plans, (2,), (0,)) == [u for u in units if u.world_sizes == (2,)]  # no gang group for W=4
    assert wide_plan_units(plans, (2, 4), (0,), most=8) == plan_units(plans, (8,), (0,))
    assert wide_plan_units(plans, (2, 4), (0,), most=4) == []  # a machine that runs 4 ranks leaves them out
    assert wide_plan_units(plans, (2, 4, 8), (0,), most=8) == []  # the sweep's own gang runs them


def test_every_plan_bench_autodist_prints_is_saved():
    from bench.calibration.llama_models import CLUSTER_RUNS
    from bench.calibration.calibrate import load_rows
    from bench.calibration.llama_models import SHAPES
    names = {p.stem for p in saved_plans()}
    assert {f"{m}-{w}" for m, ws in CLUSTER_RUNS for w in ws} <= names
    # every published row of a Llama (a transformers model verify plan rebuilds reduced; the GPT rows' is not one)
    assert {f"search-{r['name']}" for r in load_rows() if r["model"] in SHAPES} <= names


def test_full_runs_the_combined_recipe_on_every_model_and_the_default_one_unit_per_kind_cheaply(matrix):
    full, default = matrix
    kinds = {("dp", 1, (2,)), ("dp", 1, (4,)), ("hybrid", 1, (4,)), ("tp", 2, (4,))}
    for m in MODEL_NAMES:
        pipe = {("pp2_dp", 1, (4,))} if m in PIPELINE_MODELS else set()
        assert {(u.policy, u.replicas, u.world_sizes) for u in full if u.recipe and u.name == m} == kinds | pipe, m
    picked = [u for u in default if u.recipe]
    assert len(picked) == len(kinds) + 1 and {u.name for u in picked} <= set(RECIPE_MODELS)
    assert all(u.microbatches > 1 for u in picked if u.policy == "pp2_dp")


def test_full_runs_the_default_units_first_then_the_rest_each_once(matrix):
    full, default = matrix
    order = full_order(full, default)
    assert sorted(map(_same, order)) == sorted(map(_same, full)) and len(order) == len(full)
    assert [_same(u) for u in order[:len(default)]] == [_same(u) for u in default]
    assert set(order) <= set(full)  # with each unit's resume, as the matrix has it


def test_the_fastest_models_come_first(matrix):
    _, default = matrix
    assert default[0].name == "weightnorm_mlp" and default[0].kind == "model"
    first_op = next(i for i, u in enumerate(default) if u.kind == "op")
    assert all(u.name in ("weightnorm_mlp", "bucketed_mlp", "padded_gpt") for u in default[:first_op])


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 9), seed=st.integers(0, 10 ** 6))
def test_shards_are_disjoint_cover_everything_and_are_the_same_on_every_call(matrix, n, seed):
    _, default = matrix
    import random
    rng = random.Random(seed)
    times = {u.label: rng.uniform(0.1, 20) for u in default}
    shares = [shard(default, i, n, times) for i in range(1, n + 1)]
    assert sorted(u.label for s in shares for u in s) == sorted(u.label for u in default)
    assert shares == [shard(default, i, n, dict(times)) for i in range(1, n + 1)]
    for s in shares:  # each share keeps the sweep's order
        assert [default.index(u) for u in s] == sorted(default.index(u) for u in s)


def test_shares_by_recorded_times_finish_within_20_percent_of_each_other(matrix):
    _, default = matrix
    times = recorded_times()
    secs = dict(zip((u.label for u in default), estimate(default, times)))
    for n in (2, 3, 4):
        loads = [sum(secs[u.label] for u in shard(default, i, n, times)) for i in range(1, n + 1)]
        assert max(loads) <= 1.2 * min(loads), (n, loads)


def test_a_unit_of_its_own_longer_than_a_share_is_where_balance_ends():
    units = [Unit("op", f"op{i}") for i in range(5)]
    shares = assign(units, 2, {"op0": 100.0, "op1": 1, "op2": 1, "op3": 1, "op4": 1})
    assert shares[0] != shares[1] and shares[1:] == [shares[1]] * 4


@pytest.mark.parametrize("text", ["0/4", "5/4", "1", "a/b", "", "1/0", "-1/2"])
def test_a_bad_shard_is_one_line(text):
    with pytest.raises(ShardError, match="give i/N"):
        parse_shard(text)


def test_shards_that_do_not_fit_together_are_refused():
    a = {"selection": "x", "shard": 1, "shards": 2, "total": 3, "units": ["u1", "u2"]}
    b = {"selection": "x", "shard": 2, "shards": 2, "total": 3, "units": ["u3"]}
    check_shards([a, b])
    with pytest.raises(ShardError, match="shard 2/2 is missing"):
        check_shards([a])
    with pytest.raises(ShardError, match="given twice"):
        check_shards([a, a, b])
    with pytest.raises(ShardError, match="different selections"):
        check_shards([a, dict(b, selection="y")])
    with pytest.raises(ShardError, match="in two shards"):
        check_shards([a, dict(b, units=["u2"])])
    with pytest.raises(ShardError, match="2 units of the selection's 3"):
        check_shards([a, dict(b, units=[])])


def test_the_fingerprint_names_the_selection():
    us = [Unit("op", "relu"), Unit("op", "linear")]
    assert fingerprint(us) == fingerprint(list(us)) != fingerprint(us[::-1])
    assert Counter(len(fingerprint([u])) for u in us) == Counter({16: 2})


def test_every_context_parallel_policy_runs_once_on_the_sequence_models_and_leaves_the_rest_as_it_was():
    """``verify all`` verifies each cp policy (and cp pipeline) on :data:`SEQUENCE_MODELS`, the two-axis ones at
    the largest world size; adding them changes no other unit of the sample."""
    from nnscaler.policies import POLICIES as ALL
    from verify.names import SEQUENCE_POLICIES
    from verify.sweep.selection import SEQUENCE_MODELS
    full = full_units([], MODEL_NAMES, list(ALL), (2, 4), (0,), RANDOM_SEEDS, [4], [], True)
    default = default_units(full, MODEL_NAMES, list(ALL), (2, 4), RANDOM_SEEDS)
    cp = [u for u in default if u.policy in SEQUENCE_POLICIES]
    assert sorted(u.policy for u in cp) == sorted(SEQUENCE_POLICIES)
    assert all(u.name in SEQUENCE_MODELS for u in cp)
    assert all(u.world_sizes == (4,) for u in cp if "tp" in u.policy or "hybrid" in u.policy)
    assert not any(u.policy in SEQUENCE_POLICIES for u in full if u.name not in SEQUENCE_MODELS)
    plain = [p for p in ALL if p not in SEQUENCE_POLICIES]
    base_full = full_units([], MODEL_NAMES, plain, (2, 4), (0,), RANDOM_SEEDS, [4], [], True)
    base = default_units(base_full, MODEL_NAMES, plain, (2, 4), RANDOM_SEEDS)
    assert [u for u in default if u.policy not in SEQUENCE_POLICIES] == base
