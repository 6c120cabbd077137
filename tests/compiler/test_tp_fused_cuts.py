"""Column splits of a fused projection cut into parts (Mamba-2's ``in_proj`` split into z | xBC | dt,
Zamba's, Qwen3-Next's ``in_proj_qkvz``): the lone-column rule (:mod:`nnscaler.policies.lone`) follows
each part to its own reader instead of taking the cut (``split_with_sizes``, ``slice``, ``select``, a ``cat`` of parts)
for a reader of the whole, and tells a sum of two paths of one projection (a chunked scan's
``y_diag + y_off``, however long) from a residual stream the projection does not make. Under the
weaker rule tp kept these projections whole: Mamba-2's block parameters went from 99% split to 3%."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nnscaler.compile.plan import plan_graph, trace_model
from nnscaler.config import ComputeConfig
from nnscaler.policies.lone import lone_columns
from nnscaler.policies.tp_check import sharded_fraction
from verify.judge.verdict import MATCH


def _plan(model, args):
    graph = trace_model(model, args, None, registry=None, strict=False)
    return graph, plan_graph(graph, "tp", ComputeConfig(2))


def _fused(graph):
    return next(op for op in graph.ops if op.overload == "aten.linear.default")


class FusedCut(nn.Module):
    """A fused projection cut into unequal parts, each read by its own weight matrix (gate and up of
    an MLP, a mixer's z and x), the block added to the residual stream."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.fused, self.down = nn.Linear(d, 2 * d + 3 * d), nn.Linear(3 * d, d)
        self.mix = nn.Linear(2 * d, 3 * d)

    def forward(self, x):
        z, u = self.fused(x).split([2 * 64, 3 * 64], -1)
        return (x + self.down(F.silu(self.mix(z)) * u)).square().mean()


class JoinedParts(nn.Module):
    """A fused projection cut into parts and two of them joined again for one reader (Qwen3-Next's
    q | k | v | z cut, q | k | v concatenated for its convolution), the third a gate."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.fused, self.down = nn.Linear(d, 3 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        q, k, z = self.fused(x).split([64, 64, 64], -1)
        return (x + self.down(torch.cat([q, k], -1) * F.silu(z).repeat(1, 1, 2))).square().mean()


class LongSum(nn.Module):
    """Two paths of one projection summed after a long chain (a chunked scan's diagonal and
    off-diagonal blocks), then a row partner and the residual stream."""

    def __init__(self, d: int = 64, depth: int = 60):
        super().__init__()
        self.up, self.down, self.depth = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), depth

    def forward(self, x):
        h = self.up(x)
        a = h
        for _ in range(self.depth):
            a = a * 0.9 + 0.01
        return (x + self.down(F.gelu(a + h))).square().mean()


def _batch(seed: int, step: int):
    return (torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(10 * seed + step)),)


def fused_cut(seed: int):
    torch.manual_seed(seed)
    return FusedCut(), lambda step: _batch(seed, step)


def joined_parts(seed: int):
    torch.manual_seed(seed)
    return JoinedParts(), lambda step: _batch(seed, step)


def long_sum(seed: int):
    torch.manual_seed(seed)
    return LongSum(), lambda step: _batch(seed, step)


@pytest.mark.parametrize("build", [fused_cut, joined_parts, long_sum])
def test_a_fused_or_long_path_projection_keeps_its_column_split(build):
    model, batch = build(0)
    graph, plan = _plan(model, batch(0))
    op = _fused(graph)
    assert op.name not in lone_columns(graph), lone_columns(graph)
    assert plan.partition(op).axis_ids[0] is not None, plan.report()
    assert sharded_fraction(graph, plan, select=lambda n: True)[0] >= 0.5, plan.report()


def test_a_cut_part_read_whole_by_a_norm_still_keeps_the_projection_whole():
    """The rule still holds past the cut: a part a layer norm reads whole has no row partner."""

    class CutNorm(nn.Module):
        def __init__(self, d: int = 64):
            super().__init__()
            self.fused, self.norm, self.out = nn.Linear(d, d // 2 + d), nn.LayerNorm(d // 2), nn.Linear(d // 2, d)

        def forward(self, x):
            a, b = self.fused(x).split([32, 64], -1)
            return (x + self.out(self.norm(a)) * b).square().mean()

    graph, _ = _plan(CutNorm(), _batch(0, 0))
    assert _fused(graph).name in lone_columns(graph)


@pytest.mark.parametrize("build", [fused_cut, joined_parts, long_sum])
def test_the_split_fused_projection_trains_like_one_device(verify_model, build):
    rows = verify_model(build, policies=["tp"], world_sizes=(2,), steps=2)
    assert [r.status for r in rows] == [MATCH], [(r.status, r.detail) for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mamba2", "zamba"])
def test_mixer_blocks_split_at_least_one_minus_one_over_w(arch):
    """Mamba-2 (and Zamba's Mamba-2 layers): the mixer's in_proj split by columns, its block
    parameters split >= 1 - 1/W as Megatron's MambaMixer splits them (under the weaker rule: 3%, 20%)."""
    from tests.conftest import zoo_graph
    graph = zoo_graph(arch)
    plan = plan_graph(graph, "tp", ComputeConfig(2))
    assert sharded_fraction(graph, plan)[0] >= 0.5, plan.report()
