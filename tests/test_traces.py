"""The rank's trace cache (``verify/traces.py``): a model traced once is compiled under many plans,
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
    tracer = traces.tracer(("nanogpt", 0))
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
    tracer = traces.tracer(("nanogpt", 0))
    tracer(case.model, case.batch(0))
    tracer(case.model, tuple(a[:2] for a in case.batch(0)))  # other shapes
    tracer(case.model.double(), case.batch(0))  # other dtypes
    tracer(torch.nn.Sequential(torch.nn.Linear(4, 4)), (torch.randn(2, 4),))  # another model under the same key
    with pytest.warns(UnknownOperatorWarning):  # another registry: other annotations (here none)
        tracer(case.model, case.batch(0), registry=OpRegistry())
    assert (traces.misses, traces.hits) == (5, 0)


def test_the_cache_keeps_the_most_recent_graphs_only():
    model = torch.nn.Linear(4, 4)
    traces = TraceCache(keep=2)
    tracer = traces.tracer(("linear", 0))
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
