"""``tp`` splits attention by heads where the layout-following greedy left it whole
(:mod:`nnscaler.policies.heads`): on post-norm models whose hidden stream reaches the projections
split (OLMo-2/3 style, QK-norm over the whole projection), the heads split is pinned back to the
column-split projections and forward to the row-split output projection; the QK-norm's statistic
is then a partial mean (one small all-reduce). The plan is Megatron's (all-reduces only, fewer
than before), matches on real ranks, and the norm's statistic divided by the local count is caught."""
from __future__ import annotations


import pytest

import opzoo  # noqa: F401
from nnscaler import DEFAULT_REGISTRY
from nnscaler.policies import ComputeConfig
from nnscaler.policies.builtin import _tp_options, tp
from nnscaler.policies.greedy import plan_greedy
from nnscaler.policies.heads import heads_split, scores
from nnscaler.policies.refine import refine
from nnscaler.policies.tp_check import collectives
from opzoo.rulekit import EXAMPLES
from tests.conftest import FIXTURES, assert_caught_where_split, zoo_graph
from verify.config import RunConfig
from verify.judge.verdict import MATCH
from verify.runner.gang import Gang
from verify.rows.run import run_op

pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ["olmo3", "flex_olmo"])
def test_tp_pins_the_heads_split_the_greedy_missed(arch):
    graph = zoo_graph(arch)
    options = _tp_options(graph)
    before = refine(graph, plan_greedy(graph, (2,), ("tp",), options, "tp"), options)
    attn = scores(graph)
    # the greedy alone left these whole until tp paired weight matrices Megatron's way (column when fed
    # whole, row when fed split): now it splits them too, and the pin must keep them so
    assert attn
    plan = tp(graph, ComputeConfig(2))
    assert all(heads_split(op, plan) for op in attn)
    fwd = collectives(graph, plan, params=False)[0]
    assert sum(fwd.values()) <= sum(collectives(graph, before, params=False)[0].values())
    norms = [op for op in graph.ops if op.overload == "aten.mean.dim" and plan.partition(op).degree > 1]
    assert len(norms) >= 2 * len(attn)  # q and k norms: a partial statistic each



def test_partial_norm_statistics_match_and_a_local_count_is_caught():
    from tests.fixtures.wrong_rule_families import WRONG_MEAN  # registers the variant here too
    cfg = RunConfig(world_sizes=(2,), seeds=(0,))
    with Gang(2, [str(FIXTURES / "wrong_rule_families.py")], (2,)) as gang:
        for name in EXAMPLES["aten.mean.dim"]:
            for row in run_op(gang, DEFAULT_REGISTRY.get(name), cfg):
                assert row.status == MATCH, (name, row.partition, row.status, row.detail)
        (name, hidden), = WRONG_MEAN.items()
        rows = list(run_op(gang, DEFAULT_REGISTRY.get(name), cfg))
    assert_caught_where_split(rows, hidden)


@pytest.mark.parametrize("arch", ["olmo3", "albert"])
def test_pinned_heads_train_like_one_device(verify_model, arch):
    rows = verify_model(f"zoo:{arch}", policies=["tp"], world_sizes=(2,), steps=2)
    assert [r.status for r in rows] == [MATCH]
