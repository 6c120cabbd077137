"""Splits by sizes the data makes (a mixture of experts' dispatch, JetMoE's: ``x.split(counts.tolist())``,
a linear per segment, ``cat``) trace fixed-shape (``nnscaler/trace/segments.py``): no size pinned to the
sample, no guard, and the traced program equals the model on inputs that route otherwise (another rank's
shard, the next step). A segment that meets an operator that is not row-wise is traced as written,
its sizes pinned and guarded."""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import opzoo  # noqa: F401
from nnscaler.compile.plan import trace_model
from nnscaler.ir.graph import GUARD
from nnscaler.trace.build import SpecialisedBranchWarning
from nnscaler.trace.export import export_model


class TopOneMoE(nn.Module):
    """Top-1 routing, tokens sorted by expert, one linear per expert on its segment, scattered back."""

    def __init__(self, d: int = 8, experts: int = 3, mean_of_segment: bool = False):
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.weight = nn.Parameter(torch.randn(experts, d, d) / d ** 0.5)
        self.experts = experts
        self.mean_of_segment = mean_of_segment

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        logits = self.router(h)
        gate, top = logits.softmax(-1).max(-1)
        counts = F.one_hot(top, self.experts).sum(0)
        order = top.argsort(stable=True)
        pieces = h[order].split(counts.tolist(), dim=0)
        outs = [F.silu(F.linear(p, self.weight[i])) for i, p in enumerate(pieces)]
        if self.mean_of_segment:  # not row-wise: each row reads its whole segment
            outs = [o - o.mean(0, keepdim=True) for o in outs]
        y = torch.zeros_like(h).index_add(0, order, torch.cat(outs, 0) * gate[order, None])
        return y.view_as(x).pow(2).mean()


def _inputs(seed: int):
    return torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(seed))


def _routes(model, x) -> list[int]:
    return torch.bincount(model.router(x.reshape(-1, 8)).argmax(-1), minlength=3).tolist()


def test_an_experts_split_traces_fixed_shape_and_equals_the_model_on_inputs_routed_otherwise():
    torch.manual_seed(0)
    model = TopOneMoE()
    x = _inputs(0)
    ep = export_model(model, (x,))
    other = next(_inputs(s) for s in range(1, 50) if _routes(model, _inputs(s)) != _routes(model, x))
    for y in (other, other * 3):
        torch.testing.assert_close(ep.module()(y), model(y))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        graph = trace_model(model, (x,), None, registry=None, strict=False)
    assert not [op for op in graph.ops if op.overload == GUARD]
    assert not [w for w in seen if issubclass(w.category, SpecialisedBranchWarning)]
    assert "aten.split_with_sizes.default" not in [op.overload for op in graph.ops]


def test_the_gradients_of_each_expert_are_those_of_its_own_tokens():
    torch.manual_seed(1)
    model = TopOneMoE()
    ep = export_model(model, (_inputs(0),))
    program = ep.module()
    program.load_state_dict(model.state_dict(), strict=False)
    y = _inputs(7)
    want = torch.autograd.grad(model(y), [model.weight, model.router.weight])
    got = torch.autograd.grad(program(y), [dict(program.named_parameters())[n] for n in ("weight", "router.weight")])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_a_segment_read_whole_is_traced_as_written_its_sizes_pinned_and_guarded():
    torch.manual_seed(0)
    model = TopOneMoE(mean_of_segment=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        graph = trace_model(model, (_inputs(0),), None, registry=None, strict=False)
    assert [op for op in graph.ops if op.overload == GUARD]
    assert [w for w in seen if issubclass(w.category, SpecialisedBranchWarning)]
