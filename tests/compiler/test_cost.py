"""The cost model: FLOPs from annotations, alpha-beta collectives, device profiles."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from nnscaler.cost import PROFILES, ProfileError, collective_time, get_profile, op_flops, op_time, spans_nodes
from nnscaler.cost.comm import runtime_time
from nnscaler.dimops.binding import bind
from nnscaler.dimops.partition import Partition
from nnscaler.ir.graph import IROp, IRTensor
from nnscaler.ops.registry import DEFAULT_REGISTRY
import opzoo  # noqa: F401


def _op(name: str, overload: str, anno: str, shapes, out_shape) -> IROp:
    ins = [IRTensor(f"x{i}", s, torch.float32) for i, s in enumerate(shapes)]
    out = IRTensor("y", out_shape, torch.float32)
    spec = DEFAULT_REGISTRY.get(name) if name in DEFAULT_REGISTRY else None
    return IROp("op", overload, ins, [out], spec=spec or type("S", (), {"annotation": anno})(),
                bound=bind(anno, shapes, [out_shape]))


@given(b=st.integers(1, 8), m=st.integers(1, 64), k=st.sampled_from([2, 4, 8, 16]), n=st.integers(1, 64))
@settings(max_examples=25, deadline=None)
def test_matmul_flops_are_exact_and_split_by_the_partition(b, m, k, n):
    op = _op("bmm", "aten.bmm.default", "b m k+, b k+ n -> b m n", [(b, m, k), (b, k, n)], (b, m, n))
    flops, nbytes = op_flops(op, None)
    assert flops == 2 * b * m * k * n
    assert nbytes == 4 * (b * m * k + b * k * n + b * m * n)
    half, _ = op_flops(op, Partition((("k", 2),), 2))
    assert half == flops / 2


def test_attention_counts_both_contractions():
    anno = "a b s^ d^, a b t^ d^, a b t^ e -> a b s^ e"
    op = _op("sdpa", "aten.scaled_dot_product_attention.default", anno, [(2, 4, 16, 8), (2, 4, 32, 8), (2, 4, 32, 8)],
             (2, 4, 16, 8))
    assert op_flops(op, None)[0] == 2 * 2 * 4 * 16 * 32 * (8 + 8)
    assert op_flops(op, Partition((("b", 4),), 4))[0] == 2 * 2 * 1 * 16 * 32 * 16


def test_elementwise_is_memory_bound_and_splitting_speeds_it_up():
    op = _op("add", "aten.add.Tensor", "a b, a b -> a b", [(1024, 1024), (1024, 1024)], (1024, 1024))
    assert op_flops(op, None)[0] == 0
    h100 = get_profile("h100")
    assert op_time(op, Partition((("a", 8),), 8), h100, 8) < op_time(op, None, h100, 8)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_collectives_follow_alpha_beta(name):
    p = get_profile(name)
    assert p.source  # every profile says where its numbers come from
    assert collective_time("all_reduce", 1 << 20, 1, p, False) == 0.0
    small, big = (collective_time("all_reduce", n, 8, p, False) for n in (1 << 10, 1 << 30))
    assert 0 < small < big
    alpha, beta = p.link(False)
    assert big == pytest.approx(2 * 7 * alpha + 2 * 7 / 8 * (1 << 30) / beta)
    # all-reduce moves twice what all-gather moves
    ag = collective_time("all_gather", 1 << 30, 8, p, False)
    assert big - 2 * 7 * alpha == pytest.approx(2 * (ag - 7 * alpha))
    # reduce-scatter runs as a whole all-reduce in our runtime
    assert runtime_time("reduce_scatter", 1 << 20, 4, p, False) == collective_time("all_reduce", 1 << 20, 4, p, False)


def test_cluster_links_inside_and_across_nodes():
    h100 = get_profile("h100")
    assert not spans_nodes((4, 8), 1, h100) and spans_nodes((4, 8), 0, h100)
    assert spans_nodes((32,), 0, h100) and not spans_nodes((2, 4), 0, h100)
    inside = collective_time("all_reduce", 1 << 28, 8, h100, False)
    assert collective_time("all_reduce", 1 << 28, 8, h100, True) > 5 * inside  # IB is ~9x slower than NVLink


def test_an_oversubscribed_cpu_shares_its_cores():
    cpu = get_profile("cpu-gloo")
    assert cpu.throughput("float32", 4 * cpu.cores) == pytest.approx(cpu.throughput("float32", 1) / 4)


def test_unknown_profile_names_the_closest():
    with pytest.raises(ProfileError, match="unknown device profile 'a10'.*closest: 'a100'"):
        get_profile("a10")
