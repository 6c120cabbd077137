"""The causal mask each cp rank's program builds, against the memory model's term (``mask_elements`` in
``nnscaler/cluster/memory.py``): a Llama with transformers' sdpa attention (its mask built from positions, one head,
as the planner's meta trace of Llama-3 sees it) compiled under each cp scheme, the largest tensor with two
sequence-long dims measured per rank from the plan's layouts. All-gather and ring build the rank's rows only
(never the whole ``S x S``); Ulysses builds the mask whole on every rank, and the memory model must say so."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from nnscaler.cluster.cost import Parallel
from nnscaler.cluster.memory import mask_elements
from nnscaler.config import ComputeConfig
from nnscaler.dimops.layout import Shard

SEQ = 32


@pytest.fixture(scope="module")
def graph():
    import opzoo  # noqa: F401  (registers the operator annotations)
    from transformers import LlamaConfig, LlamaForCausalLM
    from nnscaler.compile.plan import trace_model
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=SEQ, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace_model(LlamaForCausalLM(cfg), (torch.zeros(1, SEQ, dtype=torch.long),), None, registry=None,
                           strict=False)


def square_per_rank(graph, policy: str, world: int) -> int:
    """Elements on one rank of the largest tensor with two ``SEQ``-long dims the plan of ``policy`` builds."""
    from nnscaler.compile.plan import choose_plan
    g = graph.copy()
    plan = choose_plan(g, policy, ComputeConfig(world))
    worst = 0
    for op in g.ops:
        if not op.known:
            continue
        lay = op.layout(plan.partition(op)).outputs
        for t, placements in zip(op.outputs, lay):
            if t is None or not hasattr(t, "shape") or sum(n == SEQ for n in t.shape) < 2 or placements is None:
                continue
            shape = list(t.shape)
            for axis, p in enumerate(placements):
                if isinstance(p, Shard):
                    shape[p.dim] //= plan.mesh_shape[axis]
            worst = max(worst, math.prod(shape))
    return worst


@pytest.mark.parametrize("policy, scheme", [("cp", "allgather"), ("cp_balanced", "allgather"),
                                            ("cp_ring_balanced", "ring"), ("ulysses", "ulysses")])
@pytest.mark.parametrize("world", [2, 4])
def test_the_memory_model_counts_the_mask_each_cp_rank_builds(graph, policy, scheme, world):
    built = square_per_rank(graph, policy, world)
    assert built == mask_elements(SEQ, SEQ, Parallel(cp=world, cp_scheme=scheme)), (policy, world, built)
    if scheme != "ulysses":  # the row-split schemes never build the whole S x S mask on a rank
        assert built * world == SEQ * SEQ, (policy, world, built)
