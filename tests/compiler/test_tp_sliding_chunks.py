"""Sliding-chunk attention (Longformer's, and so LED's encoder) splits by heads under ``tp``, and by the
batch under ``dp``.

Longformer merges the heads into the batch (``(b h)``), reads overlapping chunks of the sequence with
``as_strided`` (``nnscaler/trace/strided.py`` makes its input a contiguous copy), scores them with
``einsum``, writes the diagonals into a window with slice assignments, and its scores come out as
(batch, queries, heads, window): the heads at dim 2. Two things kept the heads whole:

* ``as_strided`` had no rule: probed, every dim came out frozen, so everything after it was computed whole
  on every rank (under ``dp`` too: 9 forward collectives in the zoo's Longformer row). ``opzoo/shape/rules.py``'s
  ``as_strided_rule`` carries each input dim the read steps through exactly (the ``(b h)`` rows, the
  head dim, a window that does not overlap), its lengths and strides ``Size`` expressions of the local lengths;
* ``heads_split`` read the heads at dim 1 of 4-d scores only; ``heads.projected`` tells a dim that holds
  heads by where it comes from (a projection's output features, never a program input).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nnscaler.policies.heads import heads_split, projected, scores
from nnscaler.policies.tp_check import collectives
from verify.judge.verdict import MATCH

from tests.fixtures.batches import tp_plan

B, T, D, H, W, V = 4, 8, 32, 4, 4, 64  # W: one side of the window (chunks of 2W, overlapping by W)


def _chunk(x, w):
    """(n, t, d) -> (n, 2 t / 2w - 1, 2w, d): chunks of 2w overlapping by w, read by ``as_strided``."""
    x = x.view(x.size(0), x.size(1) // (2 * w), 2 * w, x.size(2))
    size, stride = list(x.size()), list(x.stride())
    size[1], stride[1] = size[1] * 2 - 1, stride[1] // 2
    return x.as_strided(size, stride)


def _scores(q, k, w):
    """(b, t, h, d) x2 -> (b, t, h, 2w + 1): each query against the 2w + 1 keys around it."""
    b, t, h, d = q.shape
    q, k = (x.transpose(1, 2).reshape(b * h, t, d) for x in (q, k))
    s = torch.einsum("bcxd,bcyd->bcxy", _chunk(q, w), _chunk(k, w))
    s = F.pad(s, (0, 0, 0, 1))
    s = s.view(*s.shape[:-2], s.size(-1), s.size(-2))  # diagonals into columns
    out = s.new_zeros(b * h, t // w, w, 2 * w + 1)
    out[:, :-1, :, w:] = s[:, :, :w, : w + 1]
    out[:, -1, :, w:] = s[:, -1, w:, : w + 1]
    out[:, 1:, :, :w] = s[:, :, -(w + 1):-1, w + 1:]
    out[:, 0, 1:w, 1:w] = s[:, 0, : w - 1, 1 - w:]
    return out.view(b, h, t, 2 * w + 1).transpose(2, 1)


def _values(p, v, w):
    """(b, t, h, 2w + 1) probabilities, (b, t, h, d) values -> (b, t, h, d)."""
    b, t, h, d = v.shape
    p = p.transpose(1, 2).reshape(b * h, t // w, w, 2 * w + 1)
    v = F.pad(v.transpose(1, 2).reshape(b * h, t, d), (0, 0, w, w), value=-1)
    st = v.stride()
    v = v.as_strided((b * h, t // w, 3 * w, d), (st[0], w * st[1], st[1], st[2]))
    n, c, rows, cols = p.shape  # shift each row one further right: columns into diagonals
    p = F.pad(p, (0, rows + 1)).view(n, c, -1)[:, :, :-rows].view(n, c, rows, rows + cols)[:, :, :, :-1]
    return torch.einsum("bcwd,bcdh->bcwh", p, v).view(b, h, t, d).transpose(1, 2)


class Sliding(nn.Module):
    """A tiny Longformer: word embedding, blocks of its local attention (sequence first inside, as
    Longformer's) and an MLP, post-norm, a tied vocabulary head and cross entropy."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.emb, self.norm0 = nn.Embedding(V, D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.out = (nn.ModuleList(nn.Linear(D, D) for _ in range(layers)) for _ in range(4))
        self.up, self.down = nn.ModuleList(nn.Linear(D, 2 * D) for _ in range(layers)), nn.ModuleList(
            nn.Linear(2 * D, D) for _ in range(layers))
        self.norm1, self.norm2 = (nn.ModuleList(nn.LayerNorm(D) for _ in range(layers)) for _ in range(2))

    def forward(self, ids, labels):
        x = self.norm0(self.emb(ids))
        for wq, wk, wv, out, up, down, n1, n2 in zip(self.q, self.k, self.v, self.out, self.up, self.down,
                                                     self.norm1, self.norm2):
            h = x.transpose(0, 1)
            q, k, v = (w(h).view(T, B, H, D // H).transpose(0, 1) for w in (wq, wk, wv))
            p = F.softmax(_scores(q / (D // H) ** 0.5, k, W), -1)
            x = n1(x + out(_values(p, v, W).reshape(B, T, D)))
            x = n2(x + down(F.gelu(up(x))))
        return F.cross_entropy((x @ self.emb.weight.t()).flatten(0, 1), labels.flatten())


def sliding(seed: int):
    torch.manual_seed(seed)

    def batch(step: int):
        g = torch.Generator().manual_seed(100 * seed + step)
        return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    return Sliding(), batch


def test_the_strided_read_carries_the_rows_and_the_head_dim():
    from opzoo.rulekit import T, derive, make_call
    chunks = make_call("aten.as_strided.default", (T(2, 8, 16, 16), [16, 3, 8, 16], [16, 1024, 256, 1]))
    assert derive(chunks).annotation == "a^ b^ c d, ?, ? -> c e^ f^ d"  # (b h) rows, head dim; overlapping windows whole
    one = make_call("aten.as_strided.default", (T(8, 16, 16, 1), [16, 1, 8, 16], [16, 128, 256, 1]))
    assert derive(one).annotation == "a b c 1, ?, ? -> b 1 a c"  # one chunk: its window too
    shifted = make_call("aten.as_strided.default", (T(8, 16, 16), [16, 7, 16], [16, 256, 1], 2))
    assert derive(shifted) is None  # an absolute storage offset: a position in a storage no rank holds whole


def test_sliding_chunk_scores_split_by_heads_in_the_zoo_longformer():
    from nnscaler.compile.plan import plan_graph, trace_model
    from nnscaler.config import ComputeConfig
    from verify.models.zoo import build
    case = build("longformer", 0, 2)
    graph = trace_model(case.model, case.batch(0), None, registry=None, strict=False)
    plan = plan_graph(graph, "tp", ComputeConfig(2))
    attn = scores(graph)
    assert len(attn) == 2 and all(heads_split(op, plan) for op in attn), plan.report()
    strided = [op for op in graph.ops if op.overload == "aten.as_strided.default" and op.outputs[0].shape[0] > 4]
    assert strided and all(plan.partition(op).axis_ids[0] is not None for op in strided), plan.report()
    fwd = collectives(graph, plan, params=False)[0]
    assert fwd["all_gather"] == 0 and sum(fwd.values()) <= 2 * 2 + 2, (fwd, plan.report())  # Megatron's


def test_heads_are_told_from_queries_by_where_they_come_from():
    graph, _ = tp_plan(sliding)
    for op in scores(graph):  # (batch, queries, heads, window)
        assert [projected(op, d) for d in range(4)] == [False, False, True, False]


def test_dp_splits_the_batch_through_the_strided_reads():
    from nnscaler.compile.plan import plan_graph
    from nnscaler.config import ComputeConfig
    graph, _ = tp_plan(sliding)
    plan = plan_graph(graph, "dp", ComputeConfig(2))
    assert sum(collectives(graph, plan, params=False)[0].values()) == 1, plan.report()  # the loss alone


@pytest.mark.parametrize("build", [sliding])
def test_sliding_chunks_train_like_one_device(verify_model, build):
    rows = verify_model(build, policies=["dp", "tp"], world_sizes=(2,), steps=2)
    assert [r.status for r in rows] == [MATCH, MATCH], [(r.status, r.detail) for r in rows]
