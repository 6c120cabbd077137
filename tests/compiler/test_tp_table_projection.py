"""A projection of a fixed table (Swin-V2's continuous position bias: an MLP over a coordinate grid
the model holds, its output one bias per head) stays whole under ``tp``
(``nnscaler/policies/builtin.py``'s ``_table_projections``): it computes the same on every rank
whatever the batch, as Megatron keeps it. Left to the greedy, the MLP's first linear split its
columns and the second, splitting the heads, gathered them back: an all-gather per layer."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nnscaler.policies.tp_check import collectives
from verify.judge.verdict import MATCH

from tests.fixtures.batches import randn_batches, tp_plan

T, D, H = 8, 64, 4


class TableBias(nn.Module):
    """Attention blocks whose scores get a per-head bias from an MLP over a (T, T, 2) coordinate buffer."""

    def __init__(self, layers: int = 2):
        super().__init__()
        grid = torch.stack(torch.meshgrid(torch.arange(T), torch.arange(T), indexing="ij"), -1).float() / T
        self.register_buffer("coords", grid)
        self.q, self.k, self.v = (nn.ModuleList(nn.Linear(D, D) for _ in range(layers)) for _ in range(3))
        self.out = nn.ModuleList(nn.Linear(D, D) for _ in range(layers))
        self.cpb = nn.ModuleList(nn.Sequential(nn.Linear(2, 128), nn.ReLU(), nn.Linear(128, H, bias=False))
                                 for _ in range(layers))

    def forward(self, x):
        b = x.shape[0]
        for wq, wk, wv, out, cpb in zip(self.q, self.k, self.v, self.out, self.cpb):
            q, k, v = (w(x).view(b, T, H, D // H).transpose(1, 2) for w in (wq, wk, wv))
            bias = cpb(self.coords).permute(2, 0, 1)  # (H, T, T)
            att = F.softmax(q @ k.transpose(-1, -2) / (D // H) ** 0.5 + bias, -1)
            x = x + out((att @ v).transpose(1, 2).reshape(b, T, D))
        return x.square().mean()


def table_bias(seed: int):
    torch.manual_seed(seed)
    return TableBias(), randn_batches(seed, 4, T, D)


def test_the_table_mlp_stays_whole_and_gathers_nothing():
    graph, plan = tp_plan(table_bias)
    fwd = collectives(graph, plan, params=False)[0]
    assert fwd["all_gather"] == 0 and sum(fwd.values()) <= 3, (fwd, plan.report())  # an all-reduce per layer, the loss
    first = [op for op in graph.ops if op.overload == "aten.linear.default" and op.inputs[0].shape[-1] == 2]
    assert len(first) == 2 and all(plan.partition(op).axis_ids[0] is None for op in first), plan.report()


@pytest.mark.parametrize("build", [table_bias])
def test_the_table_bias_model_trains_like_one_device(verify_model, build):
    rows = verify_model(build, policies=["tp"], world_sizes=(2,), steps=2)
    assert [r.status for r in rows] == [MATCH], [(r.status, r.detail) for r in rows]
