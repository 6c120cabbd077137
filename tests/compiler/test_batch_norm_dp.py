"""Batch norm under data parallelism: the batch split is SyncBatchNorm's program
(``opzoo.batch_norm.rules``: one gather of per-rank (mean, squared deviations) per layer, combined
exactly), the one that equals one device. Its examples match on real ranks under every partition;
the same annotation with each rank's own statistics (DDP without SyncBatchNorm) is caught; a
convolutional network of transformers' zoo plans with one layout collective (the loss) plus one
batch-coupled collective per batch norm, and trains like one device under dp."""
from __future__ import annotations

import warnings

import pytest

import opzoo  # noqa: F401
from nnscaler import DEFAULT_REGISTRY
from nnscaler.compile.plan import plan_graph, trace_model
from nnscaler.config import ComputeConfig
from nnscaler.policies.coverage import replicated_operators
from nnscaler.policies.tp_check import collectives, coupled_collectives
from opzoo.batch_norm.rules import OVERLOAD
from opzoo.rulekit import EXAMPLES
from tests.conftest import FIXTURES, assert_caught_where_split, split_ids
from verify.config import RunConfig
from verify.judge.verdict import MATCH
from verify.runner.gang import Gang
from verify.rows.run import run_op



def test_sync_statistics_match_and_local_statistics_are_caught():
    from tests.fixtures.wrong_rule_families import WRONG_BN  # registers the variant here too
    cfg = RunConfig(world_sizes=(2, 4), seeds=(0,))
    with Gang(4, [str(FIXTURES / "wrong_rule_families.py")], (2, 4)) as gang:
        for name in EXAMPLES[OVERLOAD]:
            rows = list(run_op(gang, DEFAULT_REGISTRY.get(name), cfg))
            assert any(DEFAULT_REGISTRY.get(name).coupled[0] in split_ids(r.partition) for r in rows)
            for row in rows:
                assert row.status == MATCH, (name, row.partition, row.status, row.detail)
        (name, batch), = WRONG_BN.items()
        rows = list(run_op(gang, DEFAULT_REGISTRY.get(name), cfg))
    assert_caught_where_split(rows, batch)


pytest.importorskip("transformers")


def test_a_batch_norm_network_has_one_collective_plus_one_per_batch_norm_under_dp():
    from verify.models.zoo import build
    case = build("resnet", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace_model(case.model, case.batch(0), None, registry=None, strict=False)
    norms = sum(op.overload == OVERLOAD for op in graph.ops)
    assert norms >= 4
    dp = plan_graph(graph, "dp", ComputeConfig(2))
    assert sum(collectives(graph, dp, params=False)[0].values()) == 1  # the loss
    assert coupled_collectives(graph, dp) == norms
    assert replicated_operators(graph, dp) == []
    # the plan's cost and its one line count them too, apart from the layout conversions
    inside = [c for c in dp.stats.collectives if c.coupled]
    assert sorted(c.phase for c in inside) == ["backward"] * norms + ["forward"] * norms
    assert all(c.nbytes > 0 and c.seconds > 0 for c in inside)
    assert f"collectives 1 (+{norms} coupled) fwd" in dp.one_line()


def test_a_batch_norm_network_trains_like_one_device_under_dp(verify_model):
    rows = verify_model("zoo:resnet", policies=["dp"], world_sizes=(2,), steps=2)
    assert [r.status for r in rows] == [MATCH]
