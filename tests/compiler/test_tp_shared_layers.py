"""A shared layer (ALBERT: one layer's weights run by every layer) is a transformer layer to the tp
measures: its parameters named ``albert_layers.0`` count as block parameters (stored split by tp,
as Megatron splits them), and it counts once per run, so Megatron's bar (<= 2 forward collectives
per layer plus 4) is scaled by the layers the model runs, not by the distinct weights (#41)."""
from __future__ import annotations

import pytest

from nnscaler.compile.plan import plan_graph
from nnscaler.config import ComputeConfig
from nnscaler.policies.tp_check import layer_of, layer_paths, layer_runs, sharded_fraction
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


def test_a_layer_split_over_sibling_lists_is_a_layer():
    """XLM keeps no list of layers: layer ``i`` is ``attentions.i``, ``layer_norm1.i``, ``ffns.i`` and
    ``layer_norm2.i``, lists of one length side by side. Each index is one layer (it counted none, so
    the bar was 4 collectives), and their parameters are block parameters; an unrelated list beside no
    sibling of its length (experts, a single stack) stays what it was."""
    names = [f"t.{c}.{i}.w" for c in ("attentions", "layer_norm1", "ffns", "layer_norm2") for i in (0, 1)]
    paths = layer_paths(names + ["t.embeddings.weight", "head.experts.0.w", "head.experts.1.w", "head.experts.2.w"])
    assert {paths[n] for n in names} == {".t.#0.", ".t.#1."} and paths["t.embeddings.weight"] is None
    assert paths["head.experts.0.w"] is None  # one list alone under its parent: no layers
    graph = zoo_graph("xlm")  # 2 hidden layers
    assert layer_runs(graph) == 2
    split, held = sharded_fraction(graph, plan_graph(graph, "tp", ComputeConfig(2)))
    assert split > 0.9 and held < 0.6, (split, held)
