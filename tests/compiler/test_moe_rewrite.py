"""transformers' grouped/batched mixture-of-experts layers trace as one expert-parallel operator
(``opzoo.moe.experts.experts_rewrite``, a module rewrite of the registry): dp splits the batch with no
gather on MoE architectures the rewrite was not written for, the rewritten layer computes what the
module computes, and a layer it would compute wrongly (interleaved gate and up) is left alone."""
from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from nnscaler.compile.plan import plan_graph  # noqa: E402
from nnscaler.config import ComputeConfig  # noqa: E402
from nnscaler.policies.coverage import replicated_operators  # noqa: E402
from nnscaler.policies.tp_check import collectives  # noqa: E402
from nnscaler.trace.build import trace  # noqa: E402
from opzoo.moe.experts import OVERLOAD, experts_rewrite, transformers_forward  # noqa: E402
from verify.models.zoo import build  # noqa: E402


def _experts(model):
    return [m for m in model.modules() if experts_rewrite(m) is not None]


@pytest.mark.parametrize("arch", ["mixtral", "olmoe", "qwen2_moe", "flex_olmo"])
def test_grouped_experts_trace_as_one_operator_and_dp_gathers_nothing(arch):
    case = build(arch, 0)
    layers = _experts(case.model)
    assert layers, f"{arch}: no experts module the rewrite takes"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(case.model, case.batch(0))
    assert sum(op.overload == OVERLOAD for op in graph.ops) == len(layers)
    assert not any("grouped_mm" in op.overload or op.overload == "aten.sort.default" for op in graph.ops)
    assert all("forward" not in vars(m) for m in case.model.modules())  # the model is left as it was
    dp = plan_graph(graph, "dp", ComputeConfig(2))
    assert sum(collectives(graph, dp, params=False)[0].values()) == 1  # the loss alone
    assert replicated_operators(graph, dp) == []


def _layer_and_inputs():
    module = _experts(build("olmoe", 0).model)[0]
    g = torch.Generator().manual_seed(0)
    tokens, hidden = 12, module.gate_up_proj.shape[-1]
    x = torch.randn(tokens, hidden, generator=g)
    idx = torch.stack([torch.randperm(module.gate_up_proj.shape[0], generator=g)[:2] for _ in range(tokens)])
    w = torch.rand(tokens, 2, generator=g).softmax(-1)
    return module, x, idx, w


def test_the_rewritten_layer_computes_what_the_module_computes():
    module, x, idx, w = _layer_and_inputs()
    with torch.no_grad():
        torch.testing.assert_close(experts_rewrite(module)(x, idx, w), module(x, idx, w))


def test_a_layer_the_operator_would_compute_wrongly_is_left_alone():
    module, x, idx, w = _layer_and_inputs()

    class UpGated(type(module)):  # a gate of its own (the activation on the second half): not the operator's
        def _apply_gate(self, gate_up):
            up, gate = gate_up.chunk(2, dim=-1)
            return self.act_fn(gate) * up

    module.__class__ = UpGated
    with torch.no_grad():  # the operator forced onto it: a wrong program, which the rewrite must not make
        assert not torch.allclose(transformers_forward(module, x, idx, w), module(x, idx, w))
    assert experts_rewrite(module) is None
    module.__class__ = UpGated.__mro__[1]
    assert experts_rewrite(module) is not None
    module.has_bias = True
    assert experts_rewrite(module) is None


def test_a_rank_whose_experts_get_no_rows_still_joins_the_backward():
    """Expert parallelism's all-to-all backward runs on every rank: a rank that received no rows must
    still have a result that depends on its inputs and experts (else it skips the collective and the
    other ranks hang; afmoe did at W=2)."""
    from opzoo.moe.experts import run_experts
    x = torch.zeros(0, 8, requires_grad=True)
    gate_up, down = torch.randn(2, 12, 8, requires_grad=True), torch.randn(2, 8, 6, requires_grad=True)
    out = run_experts(x, torch.zeros(0, dtype=torch.long), gate_up, down, "silu")
    assert out.shape == (0, 8) and out.requires_grad
    out.sum().backward()
    assert gate_up.grad is not None and not gate_up.grad.any() and down.grad is not None
