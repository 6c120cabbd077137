"""Under bf16-mixed a custom operator runs under autocast, as on one device: autocast has no rule for
the operator itself but stays on inside its implementation, whose linears compute in bf16 there
(the program ran with autocast off computed them in fp32). The planner's fake run does the same."""
from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")


def _program(precision: str) -> str:
    import verify.models.hf_more as hf
    from nnscaler import ComputeConfig, plan_model
    from nnscaler.codegen.emit import generate
    from nnscaler.compile.plan import plan_graph, trace_model
    from nnscaler.compile.precision import apply_precision
    case = hf.mixtral_ep(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace_model(case.model, case.batch(0), None, registry=None, strict=False)
        apply_precision(graph, precision)
        cfg = ComputeConfig(2, precision=precision)
        plan = plan_graph(graph, "dp", cfg)
        assert plan_model(case.model, case.batch(0), "dp", cfg).stats.activation_bytes  # the fake run too
    return generate(graph, plan, 0)[0]


def test_a_custom_operator_runs_under_autocast_in_a_bf16_mixed_program():
    experts = [line for line in _program("bf16-mixed").splitlines() if "expert_parallel" in line and "=" in line]
    assert experts and all("autocast_run(opzoo.moe.experts.expert_parallel" in line for line in experts)
    plain = [line for line in _program("32-true").splitlines() if "expert_parallel" in line and "=" in line]
    assert plain and not any("autocast_run" in line for line in plain)


def test_autocast_run_computes_a_linear_in_bf16():
    from nnscaler.runtime.precision import autocast_run
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    assert autocast_run(torch.nn.functional.linear, x, w).dtype == torch.bfloat16
    assert torch.nn.functional.linear(x, w).dtype == torch.float32
