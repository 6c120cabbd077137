"""Attention masks built per row stay data parallel: ``x[arange(B)[:, None, None, None], j]`` (how
transformers builds masks from the padding mask) is rewritten to a per-row lookup whose batch dim
splits (:mod:`nnscaler.trace.arange_index`), and ``x[mask] = v`` with one value is element-wise
(``opzoo.indexing.rules``). An index that is not the identity on the rows is left alone (rewriting
it would compute another program); the encoder-decoder and speech models of transformers' zoo that
gathered their masks under ``dp`` now have one forward collective, and train like one device."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import opzoo  # noqa: F401
from nnscaler import DEFAULT_REGISTRY
from nnscaler.compile.plan import plan_graph, trace_model
from nnscaler.config import ComputeConfig
from nnscaler.policies.coverage import replicated_operators
from nnscaler.policies.tp_check import collectives
from nnscaler.trace.build import trace
from opzoo.rulekit import EXAMPLES
from verify.config import RunConfig
from verify.judge.verdict import MATCH
from verify.runner.gang import Gang
from verify.rows.run import run_op


class MaskRows(nn.Module):
    def __init__(self, rows=lambda b: torch.arange(b)):
        super().__init__()
        self.rows = rows
        self.proj = nn.Linear(6, 6)

    def forward(self, x, pad):  # x (B, L, 6), pad (B, L) bool
        b, n = pad.shape
        mask = pad[self.rows(b).view(b, 1, 1, 1), torch.arange(n).view(1, 1, 1, n)]  # (B, 1, 1, L)
        scores = (self.proj(x) @ x.transpose(1, 2)).unsqueeze(1).masked_fill(~mask, -1e4)
        return scores.softmax(-1).sum()


def _args():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, 6, generator=g), torch.rand(4, 8, generator=g) > 0.3


def _graph(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace(model, _args())


def test_rows_indexed_by_their_own_position_become_a_per_row_lookup():
    graph = _graph(MaskRows())
    assert not any(op.overload == "aten.index.Tensor" for op in graph.ops)
    assert any(op.overload == "aten.index_select.default" for op in graph.ops)
    dp = plan_graph(graph, "dp", ComputeConfig(2))
    assert sum(collectives(graph, dp, params=False)[0].values()) == 1
    assert replicated_operators(graph, dp) == []


@pytest.mark.parametrize("rows", [lambda b: torch.arange(b).flip(0), lambda b: (torch.arange(b) + 1) % b])
def test_rows_indexed_otherwise_are_left_alone(rows):
    model = MaskRows(rows)
    graph = _graph(model)
    assert any(op.overload == "aten.index.Tensor" for op in graph.ops)  # not rewritten
    x, pad = _args()  # the per-row lookup would be another program here
    b, n = pad.shape
    assert not torch.equal(pad[rows(b).view(b, 1, 1, 1), torch.arange(n).view(1, 1, 1, n)],
                           pad.index_select(1, torch.arange(n)).view(b, 1, 1, n))


def test_masked_writes_match_under_every_partition():
    names = [n for n in EXAMPLES["aten.index_put.default"] if "," in DEFAULT_REGISTRY.get(n).annotation.split("->")[0]
             and not DEFAULT_REGISTRY.get(n).annotation.startswith("a^")]
    assert names
    cfg = RunConfig(world_sizes=(2,), seeds=(0,))
    with Gang(2, [], (2,)) as gang:
        for name in names:
            rows = list(run_op(gang, DEFAULT_REGISTRY.get(name), cfg))
            assert len(rows) > 1
            for row in rows:
                assert row.status == MATCH, (name, row.partition, row.status, row.detail)


pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ["t5gemma", "granite_speech_plus"])
def test_zoo_masks_split_with_the_batch(arch):
    from verify.models.zoo import build
    case = build(arch, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace_model(case.model, case.batch(0), None, registry=None, strict=False)
    dp = plan_graph(graph, "dp", ComputeConfig(2))
    assert sum(collectives(graph, dp, params=False)[0].values()) == 1  # the loss
    assert replicated_operators(graph, dp) == []


def test_t5gemma_trains_like_one_device_under_dp(verify_model):
    rows = verify_model("zoo:t5gemma", policies=["dp"], world_sizes=(2,), steps=2)
    assert [r.status for r in rows] == [MATCH]
