"""A whole ``max()``/``min()``/``any()``/``all()`` of an integer or boolean tensor under data
parallelism (``opzoo.reduction.rules.whole_extreme_rule``): every dim splits, each rank reduces its
shard and one all-reduce per split identifier combines them (``coupled``, counted apart as batch
norm's statistics are). Its examples match on real ranks under every partition; the same annotation
with each rank's own shard reduced is caught; XLM (``assert lengths.max().item() <= slen``, a guard)
plans under dp with the loss's collective alone plus its coupled ones, keeping no operator whole."""
from __future__ import annotations

import pytest

import opzoo  # noqa: F401
from nnscaler import DEFAULT_REGISTRY
from nnscaler.compile.plan import plan_graph
from nnscaler.config import ComputeConfig
from nnscaler.policies.coverage import replicated_operators
from nnscaler.policies.tp_check import collectives, coupled_collectives
from opzoo.reduction.rules import whole_extreme_rule
from opzoo.rulekit import EXAMPLES, B, I, T, make_call
from tests.conftest import FIXTURES, assert_caught_where_split, split_ids, zoo_graph
from verify.config import RunConfig
from verify.judge.verdict import MATCH
from verify.runner.gang import Gang
from verify.rows.run import run_op

OVERLOADS = ("aten.max.default", "aten.min.default", "aten.any.default", "aten.all.default")


def test_the_rule_splits_every_dim_and_keeps_floating_tensors_whole():
    spec = whole_extreme_rule(make_call("aten.any.default", (B(4, 1, 8),)))
    assert spec.annotation == "a 1 b -> 1" and spec.coupled == ("a", "b") and not spec.differentiable
    assert whole_extreme_rule(make_call("aten.max.default", (I(4, 8),))).coupled == ("a", "b")
    floating = whole_extreme_rule(make_call("aten.max.default", (T(4, 8),)))  # its gradient: the maximal elements
    assert floating.annotation == "a^ b^ -> 1" and not floating.coupled and floating.differentiable


def test_examples_match_and_a_per_shard_reduction_is_caught():
    from tests.fixtures.wrong_rule_families import WRONG_EXTREME  # registers the variants here too
    cfg = RunConfig(world_sizes=(2, 4), seeds=(0,))
    with Gang(4, [str(FIXTURES / "wrong_rule_families.py")], (2, 4)) as gang:
        for overload in OVERLOADS:
            for name in EXAMPLES[overload]:
                spec = DEFAULT_REGISTRY.get(name)
                rows = list(run_op(gang, spec, cfg))
                assert any(split_ids(r.partition) for r in rows) == bool(spec.coupled)  # floating: read whole
                for row in rows:
                    assert row.status == MATCH, (name, row.partition, row.status, row.detail)
        for name, idents in WRONG_EXTREME.items():
            assert_caught_where_split(list(run_op(gang, DEFAULT_REGISTRY.get(name), cfg)), *idents)


pytest.importorskip("transformers")


def test_xlm_length_guard_keeps_dp_at_one_collective():
    graph = zoo_graph("xlm")
    maxima = [op for op in graph.ops if op.overload == "aten.max.default"]
    assert maxima and all(op.known for op in maxima)
    dp = plan_graph(graph, "dp", ComputeConfig(2))
    assert sum(collectives(graph, dp, params=False)[0].values()) == 1  # the loss
    assert coupled_collectives(graph, dp) == len(maxima)
    assert replicated_operators(graph, dp) == []
