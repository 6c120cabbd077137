"""A shared layer (ALBERT: one layer's weights run by every layer) is a transformer layer to the tp
measures: its parameters named ``albert_layers.0`` count as block parameters (stored split by tp,
as Megatron splits them), and it counts once per run, so Megatron's bar (<= 2 forward collectives
per layer plus 4) is scaled by the layers the model runs, not by the distinct weights (#41)."""
from __future__ import annotations

import pytest

from nnscaler.compile.plan import plan_graph
from nnscaler.config import ComputeConfig
from nnscaler.policies.tp_check import layer_of, layer_runs, sharded_fraction
from tests.conftest import zoo_graph

pytest.importorskip("transformers")


def test_prefixed_layer_lists_are_layers():
    assert layer_of("model.albert.encoder.albert_layer_groups.0.albert_layers.0.ffn.weight") == 0
    assert layer_of("model.h.3.attn.c_attn.weight") == 3
    assert layer_of("model.swin.encoder.layers.1.blocks.0.attention.self.query.weight") == 1
    assert layer_of("model.albert.embeddings.word_embeddings.weight") is None


def test_shared_layer_counts_once_per_run_and_is_split():
    graph = zoo_graph("albert")  # the zoo's ALBERT: 1 shared layer, 2 hidden layers
    assert layer_runs(graph) == 2
    split, held = sharded_fraction(graph, plan_graph(graph, "tp", ComputeConfig(2)))
    assert split > 0.9 and held < 0.6, (split, held)  # the shared attention and FFN weights split


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_unshared_layers_count_once(arch):
    graph = zoo_graph(arch)  # a weight read twice (a dtype assert beside its matmul) is still one layer
    assert layer_runs(graph) == len({layer_of(t.target or t.name) for t in graph.params} - {None})
