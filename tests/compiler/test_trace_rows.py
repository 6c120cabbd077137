"""Rows merged batch-second (``nn.MultiheadAttention``'s output projection) are merged batch-first
by the tracer, with the same values, and the batch split survives them under dp."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from nnscaler.trace.export import export_model
from nnscaler.trace.rows import batch_major_rows
from verify.models.loader import build_model


class SelfAttention(nn.Module):
    def __init__(self, batch_first: bool):
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 2, batch_first=batch_first)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_rows_are_merged_batch_first_with_the_same_values(batch_first):
    model = SelfAttention(batch_first)
    x = torch.randn(4, 6, 16)
    ep = export_model(model, (x,))
    assert batch_major_rows(ep.graph) == 1
    ep.graph_module.recompile()
    merged = [n for n in ep.graph.nodes if n.target is torch.ops.aten.reshape.default
              and tuple(n.meta["val"].shape) == (24, 16)]
    assert [tuple(n.args[0].meta["val"].shape)[:2] for n in merged] == [(4, 6) if batch_first else (6, 4)]
    torch.testing.assert_close(ep.module()(x), model(x), rtol=1e-6, atol=1e-6)


def test_a_merge_already_in_its_inputs_order_is_left_alone():
    case = build_model("nanogpt", 0)
    assert batch_major_rows(export_model(case.model, case.batch(0)).graph) == 0
