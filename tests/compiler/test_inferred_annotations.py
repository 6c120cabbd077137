"""Annotations inferred by probing (``nnscaler/trace/leaves.py``): the probe names the dims a split
keeps equal to the whole, forward and backward; an unregistered ``torch.autograd.Function`` becomes one
operator with its own backward (not dropped) and an ATen operator no rule annotates gets a probed
annotation instead of being replicated; models using either train like one device on real ranks, a
hand annotation the probe would not give is caught, and what cannot be one operator is refused in
one line."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from nnscaler.trace.leaves import infer_annotation
from verify.cli import main

FIXTURE = Path(__file__).parents[1] / "fixtures" / "function_leaves.py"


def _fixture():
    spec = importlib.util.spec_from_file_location("function_leaves_probe", FIXTURE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_probe_splits_what_stays_equal_forward_and_backward():
    m = _fixture()
    x = torch.randn(4, 6)
    assert infer_annotation(m.RoundSTE.apply, [x]) == "a b -> a b"
    assert infer_annotation(m.GlobalScaledGrad.apply, [x]) == "a^ b^ -> a^ b^"  # the backward couples every element
    assert infer_annotation(m.Scale.apply, [x, 2.0]) == "a b, ? -> a b"
    assert infer_annotation(m.RowSum.apply, [x]) == "a b+ -> a"
    assert infer_annotation(lambda t: torch.softmax(t, -1), [x]) == "a b^ -> a b^"
    assert infer_annotation(lambda t, b: t + b, [x, torch.randn(6)]) == "a b, b -> a b"
    assert infer_annotation(lambda t: t.cumsum(0), [x]) == "a^ b -> a^ b"
    assert infer_annotation(lambda t: t.sum(), [x]) == "a+ b+ -> 1"  # split by value: the halves add up
    assert infer_annotation(lambda t: t.sum(1), [x]) == "a b+ -> a"
    assert infer_annotation(lambda t: t.mean(1), [x]) == "a b^ -> a"  # the halves' means do not add up
    assert infer_annotation(lambda a, b: a @ b, [x, torch.randn(6, 5)]) == "a c+, c+ b -> a b"  # contracted together


def test_aten_operators_without_a_rule_are_probed_not_replicated():
    from nnscaler.trace.build import trace
    m = _fixture()
    graph = trace(m.NoRules(), m._batches(0))
    assert not graph.unknown()
    inferred = {o.overload: o.spec.annotation for o in graph.ops if o.spec.family == "inferred"}
    assert inferred == {"aten.logaddexp.default": "a b, a b -> a b", "aten.copysign.Tensor": "a b, a b -> a b",
                        "aten.nan_to_num.default": "a b -> a b", "aten.cummax.default": "a b^, ? -> a b^, a b^"}
    from nnscaler.compile.plan import plan_graph
    from nnscaler.config import ComputeConfig
    plan = plan_graph(graph, "dp", ComputeConfig(2))
    assert "annotations inferred by probing (no rule; verified like every plan by the harness): 4" in plan.report()
    assert {d["operator"] for d in plan.summary()["inferred_annotations"]} == \
        {"inferred." + o.removeprefix("aten.") for o in inferred}


@pytest.mark.parametrize("builder", ["ste", "global_grad", "no_rules", "row_sum"])
def test_a_model_with_its_own_functions_trains_like_one_device(tmp_path, builder, capsys):
    rows = tmp_path / "rows.json"
    assert main(["model", f"{FIXTURE}:{builder}", "--policy", "dp", "tp", "random", "--world-size", "2", "--steps",
                 "2", "--json", str(rows)]) == 0, capsys.readouterr().out[-3000:]
    assert [r["status"] for r in json.loads(rows.read_text())] == ["match"] * 3


def test_the_same_function_claimed_splittable_is_a_mismatch_under_dp(tmp_path):
    """What the probe refused (a backward over the whole input), registered by hand as split on every
    dim: dp gives each rank its half's mean, and the harness says so."""
    rows = tmp_path / "rows.json"
    assert main(["model", f"{FIXTURE}:global_grad_claimed_split", "--policy", "dp", "--world-size", "2", "--steps",
                 "1", "--json", str(rows)]) == 1
    (row,) = json.loads(rows.read_text())
    assert row["status"] == "MISMATCH" and "grad" in row["detail"], row


def test_a_function_applied_with_two_constants_is_refused_in_one_line(tmp_path, capsys):
    rows = tmp_path / "rows.json"
    assert main(["model", f"{FIXTURE}:two_constants", "--policy", "dp", "--world-size", "2", "--steps", "1",
                 "--json", str(rows)]) == 1
    (row,) = json.loads(rows.read_text())
    assert "Scale is a torch.autograd.Function applied with different non-tensor arguments" in row["detail"], row
