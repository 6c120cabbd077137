"""Issue 21: two wrong parallel programs on architectures the project never saw, both from one fault.

transformers' Whisper (keys and values through ``DynamicLayer.update``: ``torch.cat([torch.tensor([]),
k], dim=-2)``, whose 1-d empty piece the ``cat`` rule does not annotate) and xLSTM (its inference path
joins the recurrence's chunks with ``torch.concatenate``, which has no annotation) each pass tensors
to an operator with no annotation inside a *list* argument. An annotated op has its tensor lists
spread into ``IROp.inputs``; an unannotated one keeps its arguments as traced, and
``IROp.tensor_inputs`` read only the top level: the list's tensors lost that consumer, and
``IRGraph.carries_grad`` thought everything computed from the list had no gradient. The conversions
to operators split after it (``R*``: replicated for work split along the axis) then left out the
``grad_all_reduce`` that sums their partial gradients: under ``random`` plans Whisper's first
convolution's gradient came out off by 1e-4 (a ``transpose`` after the cache named first), xLSTM's
embedding's by 2e-2.

The fast tests below need no ranks (the graph and the generated program); the last ones train the
plain-torch models of the same structure (``speech_encdec``, ``xlstm_tiny``) under ``random`` at W=2
against one device: both fail on the old code (float64: conv1's gradient off by 6e-3, the
embedding's by 2e-2, against bounds of 1e-15).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from nnscaler.codegen.emit import conversion_steps, synced_params
from nnscaler.dimops.partition import Partition
from nnscaler.policies import ComputeConfig, POLICIES
from nnscaler.trace.build import UnknownOperatorWarning, trace


class ThroughAList(nn.Module):
    """``a`` -> an operator without annotation taking it in a list -> ``b`` (column-split under tp);
    ``w`` is read both by a batch-split ``mul`` and inside the list of the unannotated op."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 12)
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, x):
        h = self.a(x) * self.w
        z = torch.dstack([h, h])[..., :8]  # aten.dstack: no annotation (a 3-d cat along the last dim)
        return self.b(z).square().mean() + torch.dstack([self.w, self.w]).square().mean()


def _graph():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnknownOperatorWarning)
        return trace(ThroughAList(), (torch.randn(4, 6, 8),))


def _op(graph, overload):
    return next(op for op in graph.ops if op.overload == overload)


def test_an_unannotated_ops_list_argument_is_read():
    graph = _graph()
    cat = _op(graph, "aten.dstack.default")
    assert not cat.known, "aten.dstack got an annotation: pick another unannotated list op for this test"
    listed = [x for x in cat.inputs[0]]
    assert cat.tensor_inputs() == listed  # the list's tensors, in order
    assert all(cat in x.consumers for x in listed)
    grads = graph.carries_grad()
    assert cat.outputs[0] in grads  # the gradient flows through the list
    linear_b = [op for op in graph.ops if op.overload == "aten.linear.default"][1]
    assert linear_b.inputs[0] in grads


def test_a_split_consumer_after_the_list_sums_its_partial_gradient():
    """Under tp the second linear splits its output features: its input, replicated for split work,
    gets a partial gradient on each rank, which ``grad_all_reduce`` must sum (the old code left it out)."""
    graph = _graph()
    plan = POLICIES["tp"](graph, ComputeConfig(2))
    linear_b = [op for op in graph.ops if op.overload == "aten.linear.default"][1]
    plan.partitions[linear_b.name] = Partition.parse("n=2", 2)  # column-split, as Megatron's first linear
    z = linear_b.inputs[0]
    steps = [(step.kind, grad) for step, grad, t in conversion_steps(graph, plan, tensors=True) if t is z]
    assert ("grad_all_reduce", True) in steps


def test_a_parameter_read_inside_a_list_is_not_synced_as_a_partial_sum():
    """``w`` is read by the batch-split ``mul`` (a partial gradient per rank) and whole inside the
    dstack's list (a whole gradient on every rank): summing the two over ranks after backward
    would count the whole part twice, so ``w`` must be summed at its split use instead."""
    graph = _graph()
    plan = POLICIES["dp"](graph, ComputeConfig(2))
    w = next(t for t in graph.params if t.target == "w")
    assert w not in synced_params(graph, plan)


def through_a_list(seed: int):
    """``ThroughAList`` as a whole model: ``build(seed) -> (model, batch_fn)``."""
    torch.manual_seed(seed)
    return ThroughAList(), lambda step: (torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(10 * seed + step)),)


def test_a_model_through_a_list_trains_like_on_one_device(verify_model):
    """On the ranks: dp (``w``'s gradient, synced once, counted its whole part twice) and tp."""
    rows = verify_model(through_a_list, policies=["dp", "tp", "random"], world_sizes=(2,), steps=1, dtype="float64")
    assert len(rows) == 3


@pytest.mark.parametrize("name,seeds", [("speech_encdec", (0, 1)), ("xlstm_tiny", (0,))])
def test_models_with_list_arguments_train_like_on_one_device(verify_model, name, seeds):
    rows = verify_model(name, policies=["random"], world_sizes=(2,), seeds=seeds, steps=1, dtype="float32")
    assert [r.partition for r in rows] == ["random"] * len(seeds)
