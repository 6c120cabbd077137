"""``tp`` on attention with fewer key/value heads than ranks (multi-query and grouped-query attention
of transformers' zoo, generic tiny configs): the query heads are split, ``repeat_kv`` splits its
repeats, and no re-layout (``all_to_all``) of the expanded keys and values is left, where the
forward greedy alone had two per layer (:mod:`nnscaler.policies.refine`); the programs train like
one device; the rules the plan leans on (an ``expand`` of the repeats, the merge of (kv heads,
repeats) into heads) match under every partition and a wrong merge order is caught."""
from __future__ import annotations

import warnings

import pytest

import opzoo  # noqa: F401
from nnscaler import DEFAULT_REGISTRY
from nnscaler.policies import ComputeConfig
from nnscaler.policies.builtin import _tp_options, tp
from nnscaler.policies.greedy import plan_greedy
from nnscaler.policies.tp_check import collectives, sharded_fraction
from tests.conftest import FIXTURES, assert_caught_where_split
from verify.config import RunConfig
from verify.judge.verdict import MATCH
from verify.runner.gang import Gang
from verify.rows.run import run_op

pytest.importorskip("transformers")
from verify.models import zoo_gqa  # noqa: E402

CASES = [("qwen2_mqa", 2), ("gemma_mqa", 2), ("mistral_gqa", 4), ("starcoder2_gqa", 4)]  # kv heads < ranks


def _graph(builder):
    from nnscaler.compile.plan import trace_model
    case = (getattr(zoo_gqa, builder) if isinstance(builder, str) else builder)(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace_model(case.model, case.batch(0), None, registry=None, strict=False)


def _scores(graph):
    """The attention score matmuls (q @ k^T: (batch, heads, seq, seq)) and their heads identifier."""
    for op in graph.ops:
        if op.overload == "aten.matmul.default" and len(op.outputs[0].shape) == 4 and \
                op.outputs[0].shape[-1] == op.outputs[0].shape[-2]:
            yield op, op.bound.outputs[0][1][0]


@pytest.mark.parametrize("name, world", CASES)
def test_tp_splits_query_heads_with_no_relayout_of_kv(name, world):
    graph = _graph(name)
    plan = tp(graph, ComputeConfig(world))
    fwd, bwd = collectives(graph, plan, params=False)
    assert fwd["all_to_all"] == 0 and bwd["all_to_all"] == 0, (fwd, bwd)
    scores = list(_scores(graph))
    assert len(scores) == 2  # one per layer
    for op, heads in scores:
        assert plan.partition(op).axis_ids == (heads,), (op.name, plan.partition(op))
    assert sharded_fraction(graph, plan)[0] >= 1 - 1 / world
    # the forward greedy alone re-lays the expanded k/v out: what the reverse pass removes
    greedy = plan_greedy(graph, (world,), ("tp",), _tp_options(graph), "tp")
    before = collectives(graph, greedy, params=False)[0]
    assert sum(fwd.values()) <= sum(before.values()), (before, fwd)


def test_the_reverse_pass_leaves_megatron_plans_alone():
    """Where kv heads divide the ranks (2 of 4 at W=2) the greedy plan is Megatron's already."""
    graph = _graph(lambda seed: zoo_gqa.zoo_case("qwen2", seed, 4, 2))
    greedy = plan_greedy(graph, (2,), ("tp",), _tp_options(graph), "tp")
    assert tp(graph, ComputeConfig(2)).partitions == greedy.partitions
    assert set(collectives(graph, greedy, params=False)[0]) == {"all_reduce"}  # Megatron's: all-reduces only


@pytest.mark.parametrize("name, world", [("qwen2_mqa", 2), ("mistral_gqa", 4)])
def test_mqa_and_gqa_train_like_one_device_under_tp(verify_model, name, world):
    rows = verify_model(f"{zoo_gqa.__file__}:{name}", policies=["tp"], world_sizes=(world,), steps=2)
    assert [r.status for r in rows] == [MATCH]


def test_repeat_kv_rules_match_and_a_wrong_merge_order_is_caught():
    from tests.fixtures.wrong_rule_families import WRONG  # noqa: F401  (registers the variants here)
    right = [s.name for s in DEFAULT_REGISTRY if s.family == "rules" and (
        s.annotation == "a b c d e, ? -> a (b c) d e" or s.annotation == "a b 1 c d, ? -> a b e c d")]
    assert len(right) >= 2, right
    cfg = RunConfig(world_sizes=(2,), seeds=(0,))
    with Gang(2, [str(FIXTURES / "wrong_rule_families.py")], (2,)) as gang:
        for name in right:
            for row in run_op(gang, DEFAULT_REGISTRY.get(name), cfg):
                assert row.status == MATCH, (name, row.partition, row.detail)
        rows = list(run_op(gang, DEFAULT_REGISTRY.get("wrong.repeat_kv_merge_order"), cfg))
    # splitting the repeats as if they led the heads, or the heads as if they were the inner factor
    # (split in blocks of the repeats), hands each rank other heads
    assert_caught_where_split(rows, "b", "c")


