"""tp keeps math on small weights whole (Gemma's ``1 + w`` norms): split, each costs an all-gather where
the norm reads it, and Gemma-2's 2 layers took 15 forward collectives instead of Megatron's <= 2 per
layer plus 4 (#41). Held-out check on other families that compute on their norm weights."""
from __future__ import annotations

import pytest

from nnscaler.compile.plan import plan_graph
from nnscaler.config import ComputeConfig
from nnscaler.policies.tp_check import collectives
from tests.conftest import zoo_graph

pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ["gemma2", "gemma", "gemma3_text"])
@pytest.mark.parametrize("world", [2, 4])
def test_norm_weight_math_stays_whole(arch, world):
    graph = zoo_graph(arch)
    plan = plan_graph(graph, "tp", ComputeConfig(world))
    fwd = collectives(graph, plan, params=False)[0]
    assert "all_gather" not in fwd, fwd  # no gather of a split norm weight
    assert sum(fwd.values()) <= 2 * 2 + 4, fwd  # Megatron's bar for the zoo's 2 layers
