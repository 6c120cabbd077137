"""One compile driver: ``parallelize`` and its pipeline path refuse the same bad policies the same way
(before any process group), key their programs alike, and share one verification gate, which takes
an injected verifier (tested here with fakes, no ranks) and fails closed when none is installed."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch

import nnscaler
from nnscaler import ComputeConfig, Plan, PlanError, UnverifiedPlanWarning, parallelize, plan_model
from nnscaler.compile import artifacts, gate
from nnscaler.policies import dp


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.b(torch.relu(self.a(x))), y)


def sample():
    return torch.randn(4, 8), torch.randn(4, 4)


def label_policy(graph, config):
    return "dp"


def label_partitions(graph, config):
    plan = dp(graph, config)
    plan.partitions = {k: p.label for k, p in plan.partitions.items()}
    return plan


PATHS = {"whole": ComputeConfig(2), "pipeline": ComputeConfig(2, pp_size=2)}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("policy, message", [(label_policy, "returned str, not a Plan"),
                                             (label_partitions, "not a Partition")])
def test_both_paths_refuse_a_bad_policy_alike_before_any_process_group(path, policy, message, tmp_path):
    with pytest.raises(PlanError, match=message):
        parallelize(TwoLayers(), sample(), policy, PATHS[path], gen_savedir=tmp_path, verify=False)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("path", list(PATHS))
def test_both_paths_check_the_verify_mode(path, tmp_path):
    with pytest.raises(PlanError, match="verify must be"):
        parallelize(TwoLayers(), sample(), "dp", PATHS[path], gen_savedir=tmp_path, verify="yes")


def test_a_program_key_carries_the_code_generators_version(monkeypatch):
    before = artifacts.program_digest("graph", "plan")
    monkeypatch.setattr(artifacts, "CODEGEN_VERSION", artifacts.CODEGEN_VERSION + "x")
    assert artifacts.program_digest("graph", "plan") != before


@dataclass
class FakeVerdict:
    op: str
    spec: str
    partition: str
    ok: bool
    reason: str = ""


class FakeVerifier:
    """Says every pair passes, or that every pair fails; counts its calls. No ranks."""

    def __init__(self, ok: bool):
        self.ok, self.calls = ok, 0

    def cached(self, graph, plan, cache_path):
        return None

    def on_ranks(self, graph, plan, **kw):  # pragma: no cover (no process group here)
        raise AssertionError("plan_model verifies offline")

    def offline(self, graph, plan, cache_path):
        self.calls += 1
        return [FakeVerdict(op.name, op.spec.name, plan.partition(op).label, self.ok, "" if self.ok else "wrong")
                for op in graph.ops if op.known]


def test_the_gate_takes_an_injected_verifier():
    good = FakeVerifier(True)
    plan = plan_model(TwoLayers(), sample(), "dp", ComputeConfig(2), verify="strict", verifier=good)
    assert isinstance(plan, Plan) and good.calls == 1
    with pytest.raises(PlanError, match="failed verification"):
        plan_model(TwoLayers(), sample(), "dp", ComputeConfig(2), verify="strict", verifier=FakeVerifier(False))
    with pytest.warns(UnverifiedPlanWarning, match="failed verification"):
        plan_model(TwoLayers(), sample(), "dp", ComputeConfig(2), verify="warn", verifier=FakeVerifier(False))
    skipped = FakeVerifier(False)
    plan_model(TwoLayers(), sample(), "dp", ComputeConfig(2), verify=False, verifier=skipped)
    assert skipped.calls == 0


def test_strict_without_an_installed_verifier_refuses(monkeypatch):
    monkeypatch.setattr(gate, "default_verifier", lambda: None)
    with pytest.raises(PlanError, match="no plan verifier is installed"):
        plan_model(TwoLayers(), sample(), "dp", ComputeConfig(2), verify="strict")
    with pytest.warns(UnverifiedPlanWarning, match="no plan verifier is installed"):
        plan_model(TwoLayers(), sample(), "dp", ComputeConfig(2), verify="warn")


def test_the_installed_verifier_is_the_harness():
    from verify.plan.verifier import HarnessVerifier
    assert isinstance(gate.default_verifier(), HarnessVerifier)


def test_the_catalogue_loads_itself_on_first_use():
    """A fresh interpreter that never imports opzoo still knows aten.linear's rule."""
    import subprocess
    import sys
    code = ("import sys, torch, nnscaler\n"
            "assert 'opzoo' not in sys.modules\n"
            "class M(torch.nn.Module):\n"
            "    def __init__(self):\n        super().__init__(); self.l = torch.nn.Linear(4, 4)\n"
            "    def forward(self, x):\n        return self.l(x).sum()\n"
            "plan = nnscaler.plan_model(M(), (torch.randn(2, 4),), 'dp', nnscaler.ComputeConfig(2))\n"
            "assert 'opzoo' in sys.modules\n"
            "assert plan.summary()['replicated_operators']['count'] == 0, plan.report()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_program_is_emitted_once_per_plan(monkeypatch):
    """plan_model emits its plan's program once (for the cost estimate); parallelize passes the
    program it writes to the estimate, so neither emits twice."""
    from nnscaler.codegen import emit
    from nnscaler.cost import estimate
    calls = []
    real = emit.emit_program
    monkeypatch.setattr(estimate, "emit_program", lambda *a, **k: calls.append(1) or real(*a, **k))
    plan_model(TwoLayers(), sample(), "dp", ComputeConfig(2))
    assert len(calls) == 1
    graph = nnscaler.compile.plan.trace_model(TwoLayers(), sample(), None, registry=None, strict=False)
    plan = nnscaler.compile.plan.choose_plan(graph, "dp", ComputeConfig(2))
    steps = emit.emit_program(graph, plan, 1).steps
    nnscaler.compile.plan.attach_stats(plan, graph, ComputeConfig(2), steps)
    assert len(calls) == 1  # the estimate read the given program's steps
