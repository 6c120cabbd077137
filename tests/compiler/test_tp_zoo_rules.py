"""The rules of #41's sixth round that bring more of transformers' zoo to Megatron's bar under ``tp``
(at most 2 forward collectives per layer plus 4), and the plan report's line per cause of the rest:

- a reader whose chain of layout steps starts with an earlier reader's goes on from that reader's
  variable (a post-norm model's embedding all-reduced once for its column-parallel projection and
  its residual add, not twice: OLMo-2/3, FlexOlmo);
- a column split with no row partner stays whole (a projection whose split output a layer norm, a
  softmax or a top-k reads whole: Swin's patch merging and patch embedding, routers; a down projection
  ahead of an RMS norm: MLA's; one added to a stream it does not make: a shared expert's down
  projection after a gate and up kept whole), while a widening one ahead of a sub-norm keeps its split
  (BitNet: the norm's statistics all-reduced);
- ``Plan.report()`` says why each forward collective is issued, one line per cause.
Each rule is checked on a small model of its own (against one device on 2 ranks) and on zoo models."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nnscaler.compile.plan import plan_graph, trace_model
from nnscaler.config import ComputeConfig
from nnscaler.cost.causes import forward_causes
from nnscaler.codegen.emit import emit_program
from nnscaler.policies.tp_check import collectives, layer_runs
from verify.judge.verdict import MATCH


def _plan(model, args):
    graph = trace_model(model, args, None, registry=None, strict=False)
    return graph, plan_graph(graph, "tp", ComputeConfig(2))


class PostNorm(nn.Module):
    """A post-norm block: the embedding's output read first by a column-parallel projection, then
    whole by the residual add."""

    def __init__(self, vocab: int = 32, d: int = 16):
        super().__init__()
        self.emb, self.norm = nn.Embedding(vocab, d), nn.LayerNorm(d)
        self.up, self.down, self.head = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Linear(d, vocab)

    def forward(self, ids, labels):
        h = self.emb(ids)
        h = self.norm(h + self.down(F.gelu(self.up(h))))
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def post_norm(seed: int):
    torch.manual_seed(seed)
    ids = lambda step: torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(10 * seed + step))
    return PostNorm(), lambda step: (ids(step), ids(step + 100))


class Merging(nn.Module):
    """A narrowing projection ahead of a norm (Swin's patch merging, MLA's down projection), a router
    ahead of its top-k and a head ahead of a mean: none has a row partner."""

    def __init__(self, d: int = 128):  # wide enough that the greedy alone splits ``reduce`` by columns
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.reduce, self.norm = nn.Linear(d, d // 2), nn.LayerNorm(d // 2)
        self.router, self.out = nn.Linear(d // 2, 4), nn.Linear(d // 2, 8)

    def forward(self, x):
        h = x + self.down(F.gelu(self.up(x)))
        m = self.norm(self.reduce(h))
        w = torch.topk(self.router(m).softmax(-1), 2, -1).values.sum(-1, keepdim=True)
        return (self.out(m) * w).square().mean()


def merging(seed: int):
    torch.manual_seed(seed)
    return Merging(), lambda step: (torch.randn(4, 8, 128, generator=torch.Generator().manual_seed(10 * seed + step)),)


def test_the_embedding_is_all_reduced_once_for_a_column_reader_and_a_whole_one():
    graph, plan = _plan(*(lambda m, b: (m, b(0)))(*post_norm(0)))
    emb = next(op.outputs[0] for op in graph.ops if op.overload == "aten.embedding.default")
    e = emit_program(graph, plan, 0)
    assert [s.kind for t, _, s in e.steps if t is emb] == ["all_reduce", "grad_all_reduce"]  # once, then Megatron's f
    assert sum(collectives(graph, plan, params=False)[0].values()) == 3  # embedding, down's row output, the loss


def test_a_column_split_with_no_row_partner_stays_whole():
    model, batch = merging(0)
    graph, plan = _plan(model, batch(0))
    split = {op.name: plan.partition(op).axis_ids[0] for op in graph.ops if op.overload == "aten.linear.default"}
    up, down, reduce, router, out = split.values()
    assert (up, down) == ("n", "k") and reduce is router is out is None, split
    assert collectives(graph, plan, params=False)[0] == {"all_reduce": 1}  # down's row-parallel output alone


@pytest.mark.parametrize("build", [post_norm, merging])
def test_the_rules_train_like_one_device(verify_model, build):
    rows = verify_model(build, policies=["tp"], world_sizes=(2,), steps=2)
    assert [r.status for r in rows] == [MATCH], [(r.status, r.detail) for r in rows]


def _zoo(arch: str):
    from tests.conftest import zoo_graph
    graph = zoo_graph(arch)
    return graph, plan_graph(graph, "tp", ComputeConfig(2))


@pytest.mark.parametrize("arch", ["deepseek_v3", "swin", "olmo2"])
def test_zoo_models_over_the_bar_now_meet_it(arch):
    graph, plan = _zoo(arch)
    fwd = collectives(graph, plan, params=False)[0]
    assert sum(fwd.values()) <= 2 * layer_runs(graph) + 4, fwd
    assert not fwd.get("all_to_all") and not fwd.get("reduce_scatter"), fwd


def test_the_plan_report_says_why_each_forward_collective():
    """OLMo-2's QK-norm over the whole projection all-reduces its statistics: q's and k's in one
    collective per layer (``nnscaler/codegen/coalesce.py``), which brings it to the bar."""
    graph, plan = _zoo("olmo2")
    causes = forward_causes(graph, plan)
    assert sum(int(c.split(" x ")[0]) for c in causes) == sum(collectives(graph, plan, params=False)[0].values())
    norm = [c for c in causes if "norm over a split hidden dim: its statistics" in c]
    assert len(norm) == 1 and norm[0].startswith("2 x all_reduce"), causes  # q and k norms of 2 layers, coalesced
    assert causes[-1].startswith("1 x all_reduce: Megatron's")  # Megatron's own come last
    assert "forward collectives by cause" in plan.report() and norm[0] in plan.report()


class SubNorm(nn.Module):
    """BitNet's MLP: an RMS norm over the split intermediate between the column and row projections."""

    def __init__(self, d: int = 128):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        h = F.silu(self.gate(x)) * self.up(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (x + self.down(h)).square().mean()


def test_a_widening_projection_ahead_of_a_sub_norm_keeps_its_split():
    graph, plan = _plan(SubNorm(), (torch.randn(4, 8, 128),))
    split = [plan.partition(op).axis_ids[0] for op in graph.ops if op.overload == "aten.linear.default"]
    assert split == ["n", "n", "k"], split
    assert collectives(graph, plan, params=False)[0] == {"all_reduce": 2}  # the statistics, down's output


@pytest.mark.slow
def test_held_out_zoo_models_now_meet_the_bar():
    """Not tuned for (over the bar before these rules, W=2): MoE models with shared experts and MLA."""
    for arch in ("glm4_moe_lite", "exaone_moe", "qwen2_moe", "solar_open", "laguna"):
        graph, plan = _zoo(arch)
        fwd = sum(collectives(graph, plan, params=False)[0].values())
        assert fwd <= 2 * layer_runs(graph) + 4, (arch, fwd)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["olmo2", "deepseek_v3", "swin"])
def test_zoo_models_planned_by_the_rules_train_like_one_device(verify_model, arch):
    """The shared embedding all-reduce (OLMo-2), a shared expert's down projection and MLA's down
    projections kept whole (DeepSeek-V3), patch merging and patch embedding kept whole (Swin)."""
    rows = verify_model(f"zoo:{arch}", policies=["tp"], world_sizes=(2,), steps=2)
    assert [r.status for r in rows] == [MATCH], [(r.status, r.detail) for r in rows]


class Regression(nn.Module):
    """A prediction minus its target, squared and summed to the loss: the sum goes on into no weight."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x, y):
        return (self.proj(x) - y).square().mean()


def test_a_prediction_minus_its_target_is_not_a_residual_and_keeps_its_column_split():
    """The lone-column rule keeps whole a projection added to a stream it does not make (a residual), but
    a loss target subtracted from a prediction is not one: the column split costs one scalar all-reduce
    (the harness's wrong-annotation models rely on it)."""
    g = torch.Generator().manual_seed(0)
    graph, plan = _plan(Regression(), (torch.randn(4, 8, 64, generator=g), torch.randn(4, 8, 64, generator=g)))
    (proj,) = [op for op in graph.ops if op.overload == "aten.linear.default"]
    assert plan.partition(proj).axis_ids[0] is not None, plan.report()
