"""Megatron-grade tensor parallelism: the ``tp`` plan of nanoGPT (fused qkv), GPT-2 (Conv1D fused
qkv), Llama (GQA, rotary) and torch's TransformerEncoder (nn.MultiheadAttention) issues 2 all-reduces forward and 2 backward per layer and stores each
layer's parameters split; with ``sequence_parallel`` they become all-gather / reduce-scatter pairs;
and the programs train like one device."""
from __future__ import annotations

import math
import warnings
from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st

import opzoo  # noqa: F401
from nnscaler.comm.conversion import conversion
from nnscaler.dimops.layout import Replicate, Shard, join_blocks, piece, take_piece
from nnscaler.dimops.partition import Partition, check_partition, op_layout
from nnscaler.policies import POLICIES, ComputeConfig
from nnscaler.policies.tp_check import collectives, sharded_fraction
from nnscaler.trace.build import UnknownOperatorWarning, trace
from verify.models.registry import MODELS
from verify.models.megatron import TP_MODELS

MEGATRON = (Counter(all_reduce=2), Counter(all_reduce=2))
MEGATRON_SP = (Counter(all_gather=2, reduce_scatter=2), Counter(all_gather=2, reduce_scatter=2))


def _plan(name: str, layers: int, world: int, policy: str = "tp", **config):
    case = TP_MODELS[name](layers=layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnknownOperatorWarning)
        graph = trace(case.model, case.batch(0))
    return graph, POLICIES[policy](graph, ComputeConfig(world, **config))


def _per_layer(name: str, world: int, policy: str = "tp", params: bool = True, **config):
    (g1, p1), (g2, p2) = _plan(name, 1, world, policy, **config), _plan(name, 2, world, policy, **config)
    (f1, b1), (f2, b2) = collectives(g1, p1, params=params), collectives(g2, p2, params=params)
    return (f2 - f1, b2 - b1), sharded_fraction(g2, p2)


def _needs(name: str) -> None:
    if name != "nanogpt":
        pytest.importorskip("transformers")


# --- the plans -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["nanogpt", "gpt2", "llama", "transformer_encoder"])
def test_tp_is_megatrons_plan(name):
    _needs(name)
    world = 2
    per_layer, (split, held) = _per_layer(name, world)
    assert per_layer == MEGATRON
    assert split >= 1 - 1 / world  # of each layer's parameter elements, stored split
    assert held <= 1 / world + 0.02  # and each rank holds its 1/W share of them


@pytest.mark.parametrize("name", ["nanogpt", "llama"])
def test_sequence_parallel_turns_all_reduces_into_gather_scatter_pairs(name):
    _needs(name)
    per_layer, (split, _) = _per_layer(name, 2, sequence_parallel=True)
    assert per_layer == MEGATRON_SP
    assert split >= 0.5


@pytest.mark.parametrize("name", ["nanogpt", "gpt2", "llama"])
@pytest.mark.parametrize("sp", [False, True])
def test_hybrid_is_megatrons_plan_on_its_tp_axis(name, sp):
    """dp 2 x tp 2: the activations' collectives per layer are Megatron's (the dp axis adds none);
    the weight-gradient sums of sequence-parallel norms over both axes are left out (see tp_check)."""
    _needs(name)
    if sp and name == "gpt2":
        pytest.skip("GPT-2's Conv1D keeps an all-reduce under sequence parallelism (bench/studies/tp_collectives.py)")
    per_layer, (split, held) = _per_layer(name, 4, "hybrid", params=not sp, tp_size=2, sequence_parallel=sp)
    assert per_layer == (MEGATRON_SP if sp else MEGATRON)
    assert split >= 0.5 and held <= 0.5 + 0.02


def test_fused_qkv_is_split_by_heads_and_small_tensors_stay_whole():
    graph, plan = _plan("nanogpt", 1, 2)
    labels = {op.overload.split(".")[1]: plan.partition(op).label for op in graph.ops}
    ops = {op.name: plan.partition(op).label for op in graph.ops}
    assert ops["linear"] == "n=2/3" and ops["split"] == "d=2"  # this rank's heads of q, of k and of v
    assert ops["scaled_dot_product_attention"] == "b=2"  # attention by heads
    assert ops["embedding"] == "v=2" and ops["embedding_1"] == "~=2"  # words by vocabulary; positions whole
    assert labels["cross_entropy_loss"] == "v=2"
    from nnscaler.codegen.emit import stored_layouts
    stored = {t.target: lay for t, lay in stored_layouts(graph, plan).items()}
    assert stored["h.0.attn.c_attn.weight"] == (Shard(0, 3),)
    assert stored["h.0.ln_1.weight"] == (Replicate(),) and stored["wpe.weight"] == (Replicate(),)


def test_a_contiguous_split_is_not_taken_for_a_split_in_blocks():
    # rows 0..n/2 of a fused qkv are q and half of k: never the heads a (3 d) consumer wants
    steps, cost = conversion((Shard(2),), (Shard(2, 3),), ("d",), (2,), 3, True)
    assert [s.kind for s in steps] == ["all_gather", "split"] and cost > 0
    steps, cost = conversion((Shard(2, 3),), (Shard(2, 3),), ("d",), (2,), 3, True)
    assert steps == [] and cost == 0


# --- the layout that splits one factor of a fused dim -------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.sampled_from([1, 2, 3]), st.sampled_from([2, 4]), st.integers(1, 3), st.integers(0, 2))
def test_pieces_in_blocks_join_back_to_the_whole(chunk, blocks, world, other, dim):
    shape = [other + 1, other + 2, other]
    shape.insert(dim, chunk * blocks * world)
    full = torch.arange(math.prod(shape)).reshape(shape)
    lay = (Shard(dim, blocks),)
    parts = [take_piece(full, piece(tuple(shape), lay, (world,), (c,))) for c in range(world)]
    assert torch.equal(join_blocks(parts, dim, blocks), full)
    # coordinate c holds its chunk of every block, in block order
    want = torch.cat([b.chunk(world, dim)[1] for b in full.chunk(blocks, dim)], dim)
    assert torch.equal(parts[1], want)
    if blocks > 1:  # a contiguous chunk is a different piece
        assert not torch.equal(parts[1], full.chunk(world, dim)[1])


def test_a_factor_after_fixed_counts_splits_in_blocks():
    from nnscaler.dimops.binding import bind
    b = bind("a (3 d) -> a d, a d, a d", [(2, 12)])
    p = Partition.parse("d=2", 2)
    check_partition(b, p)
    lay = op_layout(b, p)
    assert lay.inputs == ((Shard(1, 3),),) and lay.outputs == ((Shard(1),),) * 3
    b2 = bind("a n, n k -> a k", [(2, 12), (12, 4)])
    p2 = Partition((("n", 2),), 2, (("n", 3),))
    assert p2.label == "n=2/3" and Partition.parse("n=2/3", 2) == p2
    assert op_layout(b2, p2).inputs == ((Shard(1, 3),), (Shard(0, 3),))
    with pytest.raises(Exception, match="not divisible by 12"):
        check_partition(bind("a n -> a n", [(2, 6)]), Partition((("n", 2),), 2, (("n", 6),)))


# --- the programs train like one device ----------------------------------------------------------

@pytest.mark.parametrize("name,policy,world", [("tp_nanogpt", "tp", 2), ("tp_gpt2", "tp", 2), ("tp_llama", "tp", 2),
                                               ("tp_nanogpt", "tp_sp", 2), ("tp_llama", "tp_sp", 2),
                                               ("tp_nanogpt", "hybrid", 4), ("tp_nanogpt", "tp_sp", 4),
                                               ("tp_nanogpt", "hybrid_sp", 4), ("tp_llama", "hybrid_sp", 4),
                                               ("tp_transformer_encoder", "tp", 2), ("tp_transformer_encoder", "tp", 4)])
def test_tp_programs_train_like_one_device(verify_model, name, policy, world):
    if name not in MODELS:
        pytest.skip(f"{name} needs transformers (pip install -e '.[models]')")
    assert len(verify_model(name, policies=[policy], world_sizes=[world], steps=2)) == 1
