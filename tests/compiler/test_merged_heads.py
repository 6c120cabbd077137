"""Attention written with ``bmm`` merges the heads into the batch (``view(b*h, s, d)``: 3-d scores;
TrOCR, WavLM and the BART generation of models), and ``F.multi_head_attention_forward``-style code
merges the batch into rows (``(s*b, e)``). The inner factor of such a merge is split in blocks
(:mod:`nnscaler.dimops.partition`): ``tp`` splits the 3-d scores by heads (the greedy follows the
blocks its inputs hold; :mod:`nnscaler.policies.heads` pins them where the greedy does not), ``dp``
follows the batch through the rows in blocks (a reduced loss reads them in any order), and both
train like one device on real ranks."""
from __future__ import annotations


import pytest

from nnscaler.dimops.layout import Shard
from nnscaler.policies import ComputeConfig
from nnscaler.policies.builtin import dp, tp
from nnscaler.policies.coverage import replicated_operators
from nnscaler.policies.heads import heads_split, scores
from nnscaler.policies.tp_check import collectives
from tests.conftest import zoo_graph
from verify.judge.verdict import MATCH

pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ["trocr", "wavlm"])
def test_tp_splits_bmm_attention_by_heads_in_blocks(arch):
    graph = zoo_graph(arch)
    attn = [op for op in scores(graph) if len(op.outputs[0].shape) == 3]
    assert attn, "the model's attention is no longer written with bmm: pick another"
    plan = tp(graph, ComputeConfig(2))
    assert all(heads_split(op, plan) for op in attn)
    for op in attn:  # each rank its heads inside every batch row: dim 0 in as many blocks as the batch
        (q,) = op.layout(plan.partition(op)).outputs[0]
        assert isinstance(q, Shard) and q.dim == 0 and q.blocks == graph.inputs[0].shape[0]
    if arch == "trocr":  # a plain decoder (wavlm's conv front end has its own): Megatron's all-reduces only
        assert set(collectives(graph, plan, params=False)[0]) == {"all_reduce"}


def test_dp_follows_the_batch_through_rows_merged_sequence_major():
    graph = zoo_graph("wavlm")  # (seq, batch*heads, d) -> rows (seq*batch, e) for the output projection
    plan = dp(graph, ComputeConfig(2))
    assert sum(collectives(graph, plan, params=False)[0].values()) == 1  # the loss
    assert not replicated_operators(graph, plan)
    rows = [op for op in graph.ops if op.known and "_unsafe_view" in op.overload]
    assert rows and all(op.layout(plan.partition(op)).outputs[0][0].blocks > 1 for op in rows)


def test_a_reduced_loss_reads_rows_split_in_blocks():
    """ProphetNet's loss reads rows (n-gram streams x batch x tokens): the batch is their inner
    factor. The loss kernel sums the rows and counts them, in any order (``OpSpec.unordered``), so
    it follows the blocks instead of converting them: one forward collective, the loss."""
    graph = zoo_graph("prophetnet")
    plan = dp(graph, ComputeConfig(2))
    assert sum(collectives(graph, plan, params=False)[0].values()) == 1
    (loss,) = [op for op in graph.ops if op.overload == "aten.nll_loss_nd.default"]
    assert loss.spec.unordered and plan.partition(loss).blocks


@pytest.mark.parametrize("arch, policy, world", [("trocr", "tp", 2), ("wavlm", "tp", 4), ("wavlm", "dp", 2),
                                                 ("prophetnet", "dp", 2)])
def test_merged_heads_and_rows_train_like_one_device(verify_model, arch, policy, world):
    rows = verify_model(f"zoo:{arch}", policies=[policy], world_sizes=(world,), steps=2)
    assert [r.status for r in rows] == [MATCH], [(r.status, r.detail) for r in rows]
