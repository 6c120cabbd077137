"""Tracing: a model becomes IR operators annotated from the one registry; bad input is a clear error."""
from __future__ import annotations

import warnings

import pytest
import torch

import opzoo  # noqa: F401
from nnscaler import OpRegistry, register_op
from nnscaler.ir.graph import PARAM
from nnscaler.trace.build import UnknownOperatorWarning, trace
from nnscaler.trace.export import TraceError

from verify.models.nanogpt import GPT, GPTConfig

PARTITIONED = {"aten.linear.default", "aten.embedding.default", "aten.layer_norm.default",
               "aten.scaled_dot_product_attention.default", "aten.cross_entropy_loss.default"}


@pytest.fixture(scope="module")
def gpt_graph():
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    idx, tgt = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnknownOperatorWarning)
        return model, trace(model, (idx, tgt))


def test_gpt_operators_carry_annotations_from_the_registry(gpt_graph):
    model, g = gpt_graph
    for op in g.ops:
        if op.overload in PARTITIONED:
            assert op.known, op
            assert op.bound.sizes  # bound to the node's shapes
    assert {p.target for p in g.params} == {n for n, _ in model.named_parameters()}
    assert all(p.kind == PARAM for p in g.params)
    assert [t.shape for t in g.inputs] == [(2, 8), (2, 8)]
    assert len(g.outputs) == 1 and g.outputs[0].shape == ()


def test_operators_point_back_to_the_model_source(gpt_graph):
    _, g = gpt_graph
    sdpa = next(op for op in g.ops if op.overload == "aten.scaled_dot_product_attention.default")
    assert "nanogpt.py" in sdpa.source and "scaled_dot_product_attention" in sdpa.source


def test_consumers_and_producers_link_up(gpt_graph):
    _, g = gpt_graph
    for op in g.ops:
        for t in op.tensor_inputs():
            assert op in t.consumers
        for t in op.outputs:
            assert t is None or t.producer is op


class _Bessel(torch.nn.Module):
    def forward(self, x, n):
        return torch.special.bessel_j0(x).sum() + torch.gcd(n, n + 1).sum()


def test_unknown_operators_are_named_once_or_refused_in_strict_mode():
    """bessel_j0 has no rule and is probed (elementwise); gcd's integer inputs cannot be probed
    (their values would be guesses): it stays unknown, named once, refused under strict."""
    x, n = torch.randn(4, 8), torch.arange(32).reshape(4, 8)
    with pytest.warns(UnknownOperatorWarning, match=r"1 operators .* aten.gcd.default x1"):
        g = trace(_Bessel(), (x, n))
    assert [op.overload for op in g.unknown()] == ["aten.gcd.default"]
    (bessel,) = [op for op in g.ops if op.overload == "aten.special_bessel_j0.default"]
    assert (bessel.spec.family, bessel.spec.annotation) == ("inferred", "a b -> a b")
    with pytest.raises(TraceError, match="gcd"):
        trace(_Bessel(), (x, n), strict=True)


def test_sample_arguments_that_do_not_match_forward():
    with pytest.raises(TraceError, match=r"GPT.forward\(idx, targets\).*targets"):
        trace(GPT(), (torch.zeros(2, 8, dtype=torch.long),))


class _DataDependent(torch.nn.Module):
    def forward(self, x):  # a size from a data-dependent float: no check of it survives (trace/branches.py)
        return x.sum() + torch.ones(int(x.abs().sum().item() ** 0.5)).sum()


def test_untraceable_model_names_the_model_and_the_line():
    with pytest.raises(TraceError, match=r"cannot trace _DataDependent: .*test_trace.py:\d+ in forward: return x.sum\(\) \+ torch.ones"):
        trace(_DataDependent(), (torch.randn(3),))


@torch.library.custom_op("nnscaler_test::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


twice.register_fake(lambda x: torch.empty_like(x))
twice.register_autograd(lambda ctx, g: g * 2)


class _UsesCustom(torch.nn.Module):
    def forward(self, x):
        return twice(x).sum()


def test_custom_op_stays_one_node_and_is_annotated():
    reg = OpRegistry()
    register_op("* -> *", "twice", registry=reg)(twice)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnknownOperatorWarning)
        g = trace(_UsesCustom(), (torch.randn(4, 8),), registry=reg)
    (op,) = [op for op in g.ops if op.overload == "nnscaler_test.twice.default"]
    assert op.known and op.spec.name == "twice" and op.bound.sizes == {"*0": 4, "*1": 8}


def test_as_strided_of_a_transposed_view_reads_a_contiguous_copy_and_of_a_slice_is_refused():
    """A view that covers its storage exactly (Longformer's transposed chunks) is read through a copy laid
    out in its storage's order (``nnscaler/trace/strided.py``; matched on ranks by
    ``tests/compiler/test_strided.py``); a view with gaps (a slice) is refused naming its line, never a wrong
    program (Longformer and LED traced to a MISMATCH before the refusal)."""
    from tests.fixtures.strided_chunks import build, sliced
    model, batch = build(0)
    ops = [op.overload for op in trace(model, batch(0)).ops]
    at = ops.index("aten.as_strided.default")
    assert ops[at - 2: at] == ["aten.permute.default", "aten.clone.default"], ops
    model, batch = sliced(0)
    with pytest.raises(TraceError, match=r"as_strided.*strided_chunks.py:\d+.*reads the storage of a non-contiguous view"):
        trace(model, batch(0))
