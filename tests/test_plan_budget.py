"""Plans never quietly worse than they look: a dp batch the world size does not divide is refused, and a
plan whose estimated peak exceeds the memory budget or the device warns, whatever the policy."""
from __future__ import annotations

import warnings

import pytest
import torch

import opzoo  # noqa: F401
from nnscaler import ComputeConfig, PlanError
from nnscaler.compile.plan import PlanWarning, canonical_params, plan_graph
from nnscaler.trace.build import trace
from verify.models.nanogpt import GPT, GPTConfig


def _gpt(batch: int, width: int = 64, layers: int = 2):
    with torch.device("meta"):
        m = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=layers, n_head=4, n_embd=width))
        idx = torch.zeros(batch, 32, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = trace(m, (idx, idx))
    canonical_params(m, g)
    return g


def test_dp_refuses_a_batch_the_world_does_not_divide():
    with pytest.raises(PlanError, match=r"dp: the batch of .* \(3\) is not divisible by the 2 ranks.* 2 or 4"):
        plan_graph(_gpt(3), "dp", ComputeConfig(2))
    plan = plan_graph(_gpt(4), "dp", ComputeConfig(2))  # a batch it divides still plans
    assert plan.axis_names == ("dp",)


def test_a_plan_over_the_budget_warns_and_one_within_does_not():
    g = _gpt(4)
    with pytest.warns(PlanWarning, match="exceeds mem_budget"):
        plan_graph(g, "tp", ComputeConfig(2, mem_budget=1024))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanWarning)
        plan_graph(g, "tp", ComputeConfig(2, mem_budget=2**34))
