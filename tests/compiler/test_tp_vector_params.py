"""Vectors among a ``tp`` operator's parameters (a norm's weight, a bias, a layer scale) follow the
split their input already holds and never start one (``nnscaler/policies/builtin.py``'s Megatron
options): Megatron keeps them whole. Allowed to split on the vector's own dim, DINOv2's layer scale
took the row-parallel output reduce-scattered by hidden (cheaper than an all-reduce, one step
ahead), its residual stream split after it, and the next norm gathered it back: two collectives per
sublayer where Megatron issues one."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from nnscaler.policies.tp_check import collectives
from verify.judge.verdict import MATCH

from tests.fixtures.batches import tp_plan


class LayerScale(nn.Module):
    """Pre-norm MLP blocks whose output a per-channel scale multiplies before the residual add (DINOv2,
    CaiT), a final norm and a head."""

    def __init__(self, d: int = 64, layers: int = 2):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.ups = nn.ModuleList(nn.Linear(d, 4 * d) for _ in range(layers))
        self.downs = nn.ModuleList(nn.Linear(4 * d, d) for _ in range(layers))
        self.scales = nn.ParameterList(nn.Parameter(torch.full((d,), 0.5)) for _ in range(layers))
        self.final, self.head = nn.LayerNorm(d), nn.Linear(d, 8)

    def forward(self, x):
        for norm, up, down, scale in zip(self.norms, self.ups, self.downs, self.scales):
            x = x + scale * down(torch.relu(up(norm(x))))
        return self.head(self.final(x)).square().mean()


def layer_scale(seed: int):
    torch.manual_seed(seed)
    return LayerScale(), lambda step: (torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(10 * seed + step)),)


def test_a_layer_scale_keeps_the_row_parallel_output_whole():
    graph, plan = tp_plan(layer_scale)
    fwd = collectives(graph, plan, params=False)[0]
    # one all-reduce per block's row-parallel output (the head's columns gathered for the loss: one more)
    assert fwd["reduce_scatter"] == 0 and sum(fwd.values()) <= 3, (fwd, plan.report())
    scale = next(t for t in graph.params if (t.target or t.name).startswith("scales"))
    assert all(plan.partition(op).axis_ids[0] is None for op in scale.consumers), plan.report()


@pytest.mark.parametrize("build", [layer_scale])
def test_the_layer_scale_model_trains_like_one_device(verify_model, build):
    rows = verify_model(build, policies=["tp"], world_sizes=(2,), steps=2)
    assert [r.status for r in rows] == [MATCH], [(r.status, r.detail) for r in rows]
