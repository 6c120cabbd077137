"""A projection whose split is summed away before any weight matrix reads it, the sum going on into
the model (the lightning indexer of DeepSeek-V3.2-style sparse attention: per-head scores
``relu(q k)`` weighted and summed over the index heads, then a top-k of tokens), stays whole under
``tp`` (``nnscaler/policies/lone.py``): it has no row partner, as vLLM and Megatron keep the indexer
replicated. Split by its heads, the weighted sum was all-reduced once per layer (dots3_note_text,
hy_v4). A widening projection whose split only a norm's statistics reduce on the way to its partner
keeps it (BitNet, ``test_tp_zoo_rules.py``), and so does one reduced into the loss alone."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nnscaler.policies.lone import lone_columns
from nnscaler.policies.tp_check import collectives
from verify.judge.verdict import MATCH

from tests.fixtures.batches import randn_batches, tp_plan

D, H, DH, T = 128, 4, 32, 8


class Indexer(nn.Module):
    """An MLP block reading its input's rows mixed by a top-2 token mask an index scorer picks."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.weights = nn.Linear(D, H * DH), nn.Linear(D, DH), nn.Linear(D, H)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        b = x.shape[0]
        q = self.wq(x).view(b, T, H, DH)
        k = self.wk(x).unsqueeze(1).transpose(-1, -2)  # (b, 1, DH, T)
        scores = F.relu(q @ k)  # (b, T, H, T)
        index = (self.weights(x).unsqueeze(-2) @ scores).squeeze(-2)  # (b, T, T): summed over the heads
        keep = torch.zeros_like(index).scatter(-1, index.topk(2, -1).indices, 1.0)
        return (x + self.down(F.gelu(self.up(keep @ x)))).square().mean()


def indexer(seed: int):
    torch.manual_seed(seed)
    return Indexer(), randn_batches(seed, 4, T, D)


def test_the_index_projection_stays_whole_and_its_sum_needs_no_collective():
    graph, plan = tp_plan(indexer)
    wq = next(op for op in graph.ops if op.overload == "aten.linear.default")
    assert wq.name in lone_columns(graph)
    assert plan.partition(wq).axis_ids[0] is None, plan.report()
    assert collectives(graph, plan, params=False)[0] == {"all_reduce": 1}, plan.report()  # the MLP's down


@pytest.mark.parametrize("build", [indexer])
def test_the_indexer_model_trains_like_one_device(verify_model, build):
    rows = verify_model(build, policies=["tp"], world_sizes=(2,), steps=2)
    assert [r.status for r in rows] == [MATCH], [(r.status, r.detail) for r in rows]
