"""The rank's trace cache (``verify/traces.py``): a model traced once is compiled under many plans,
each on its own copy; anything the trace depends on (arguments, structure, registry) misses."""
from __future__ import annotations

import torch

from nnscaler.ops.registry import OpRegistry
from nnscaler.trace.build import trace
from verify.models.builders import build_model
from verify.traces import TraceCache


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
    tracer(case.model, case.batch(0), registry=OpRegistry())  # another registry: other annotations
    assert (traces.misses, traces.hits) == (5, 0)


def test_the_cache_keeps_the_most_recent_graphs_only():
    model = torch.nn.Linear(4, 4)
    traces = TraceCache(keep=2)
    tracer = traces.tracer(("linear", 0))
    for rows in (2, 3, 4, 2):
        tracer(model, (torch.randn(rows, 4),))
    assert traces.misses == 4 and len(traces.graphs) == 2
