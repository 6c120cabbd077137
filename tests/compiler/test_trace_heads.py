"""``nn.MultiheadAttention``'s packed projection and its heads merged into the batch are rewritten by
the tracer (``nnscaler/trace/heads.py``) so that the heads stay a dimension of their own, with the
same values; tensor parallelism then splits attention by heads (``tests/compiler/test_tp.py``)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from nnscaler.trace.export import export_model
from nnscaler.trace.heads import heads_outer
from verify.models.loader import build_model

aten = torch.ops.aten


class SelfAttention(nn.Module):
    def __init__(self, batch_first: bool, kdim: int | None = None):
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 4, batch_first=batch_first, kdim=kdim, vdim=kdim)

    def forward(self, x, kv):
        return self.mha(x, kv, kv, need_weights=False)[0]


@pytest.mark.parametrize("batch_first", [True, False])
def test_heads_are_kept_apart_with_the_same_values(batch_first):
    model = SelfAttention(batch_first)
    x = torch.randn(3, 5, 16)
    want = model(x, x)
    ep = export_model(model, (x, x))
    assert heads_outer(ep.graph) == 4  # the packed unpacking, and q, k and v kept apart from the batch
    ep.graph_module.recompile()
    sdpa = [n for n in ep.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    assert [tuple(a.meta["val"].shape) for a in sdpa[0].args[:3]] == [(3 if batch_first else 5, 4, 5 if batch_first else 3, 4)] * 3
    assert all(a.target is aten.permute.default for a in sdpa[0].args[:3])  # heads a dim of their own
    assert not any(n.target is aten.unflatten.int for n in ep.graph.nodes)
    assert torch.equal(ep.module()(x, x), want)  # the same elements by another route: bit for bit


def test_separate_projections_keep_heads_apart_and_other_models_are_left_alone():
    model = SelfAttention(True, kdim=8)  # q, k and v projected apart: only the head merges are rewritten
    x, kv = torch.randn(3, 5, 16), torch.randn(3, 5, 8)
    want = model(x, kv)
    ep = export_model(model, (x, kv))
    assert heads_outer(ep.graph) == 3
    ep.graph_module.recompile()
    assert torch.equal(ep.module()(x, kv), want)
    case = build_model("nanogpt", 0)  # its heads are a dimension already
    assert heads_outer(export_model(case.model, case.batch(0)).graph) == 0
