"""The rank's trace cache (``verify/cases/traces.py``): a model traced once is compiled under many plans,
each on its own copy; anything the trace depends on (arguments, structure, registry) misses."""
from __future__ import annotations

import pytest
import torch

from nnscaler.ops.registry import OpRegistry
from nnscaler.trace.build import UnknownOperatorWarning, trace
from verify.models.loader import build_model
from verify.cases.traces import TraceCache


def test_a_second_compile_gets_a_copy_of_the_same_graph():
    case = build_model("nanogpt", 0)
    traces = TraceCache()
    tracer = traces.tracer("nanogpt")
    first = tracer(case.model, case.batch(0))
    second = tracer(build_model("nanogpt", 0).model, case.batch(1))  # another batch of the same shapes
    assert (traces.misses, traces.hits) == (1, 1)
    assert str(first) == str(second) == str(trace(case.model, case.batch(0)))
    assert first.ops[0] is not second.ops[0] and first.params[0] is not second.params[0]
    assert first.ops[0].spec is second.ops[0].spec  # the registry's, shared
    first.params[0].target = "renamed"  # parallelize renames tied parameters on its copy
    first.ops.clear()
    third = tracer(case.model, case.batch(0))
    assert str(third) == str(second) and third.params[0].target != "renamed"


def test_what_the_trace_depends_on_misses_the_cache():
    case = build_model("nanogpt", 0)
    traces = TraceCache()
    tracer = traces.tracer("nanogpt")
    tracer(case.model, case.batch(0))
    tracer(case.model, tuple(a[:2] for a in case.batch(0)))  # other shapes
    tracer(case.model.double(), case.batch(0))  # other dtypes
    tracer(torch.nn.Sequential(torch.nn.Linear(4, 4)), (torch.randn(2, 4),))  # another model under the same key
    with pytest.warns(UnknownOperatorWarning):  # another registry: other annotations (here none)
        tracer(case.model, case.batch(0), registry=OpRegistry())
    assert (traces.misses, traces.hits) == (5, 0)


class _Scaled(torch.nn.Module):
    """A model whose builder draws a scale and a mask from its seed: values the trace bakes in."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = torch.nn.Linear(4, 4)
        self.scale = float(torch.rand(1, generator=g))
        self.mask = torch.rand(4, generator=g) > 0.5  # a plain tensor attribute: a lifted constant

    def forward(self, x):
        return (self.lin(x) * self.scale).masked_fill(self.mask, 0.0).sum()


def test_another_seed_shares_the_trace_unless_the_seed_changed_what_the_trace_bakes_in():
    traces = TraceCache()
    tracer = traces.tracer("nanogpt")
    one, other = build_model("nanogpt", 0), build_model("nanogpt", 1)  # other weights, same program
    assert str(tracer(one.model, one.batch(0))) == str(tracer(other.model, other.batch(0)))
    assert (traces.misses, traces.hits) == (1, 1)
    scaled = traces.tracer("scaled")
    x = (torch.randn(2, 4),)
    graphs = [scaled(_Scaled(s), x) for s in (0, 1)]
    assert (traces.misses, traces.hits) == (3, 1)  # the second seed's scale and mask: a trace of its own
    assert str(graphs[0]) != str(graphs[1]) or any(
        not torch.equal(a, b) for a, b in zip(graphs[0].constants.values(), graphs[1].constants.values()))
    scaled(_Scaled(0), x)
    assert traces.hits == 2


def test_the_cache_keeps_the_most_recent_graphs_only():
    model = torch.nn.Linear(4, 4)
    traces = TraceCache(keep=2)
    tracer = traces.tracer("linear")
    for rows in (2, 3, 4, 2):
        tracer(model, (torch.randn(rows, 4),))
    assert traces.misses == 4 and len(traces.graphs) == 2


class _Chain(torch.nn.Module):
    """A long chain of operators: each output links to the next op (a deep model's graph)."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.w = n, torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        for _ in range(self.n):
            x = x * self.w
        return x.sum()


def _links(graph) -> list:
    """Every tensor's producer and consumers, by name, in graph order (what a copy must keep)."""
    seen, out = set(), []
    for op in graph.ops:
        for t in (*op.tensor_inputs(), *op.outputs):
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                out.append((t.name, t.producer and t.producer.name, [c.name for c in t.consumers]))
    return out


def test_a_copy_keeps_every_link_and_a_deep_graph_copies_without_recursion():
    for model, args in ((build_model("nanogpt", 0).model, build_model("nanogpt", 0).batch(0)),
                        (_Chain(600), (torch.randn(3, 4),))):
        graph = trace(model, args)
        copy = graph.copy()
        assert _links(copy) == _links(graph) and str(copy) == str(graph)
        assert not {id(t) for op in copy.ops for t in op.outputs} & {id(t) for op in graph.ops for t in op.outputs}
        assert [t.name for t in copy.params] == [t.name for t in graph.params]
        assert all(t.consumers for t in copy.params if t.consumers is not None)
