"""Models that branch on their data (issue 41 item 3): where ``torch.export`` stops at a
data-dependent guard (``if h.sum() > 0:``, DeBERTa-v2's ``if label_index.size(0) > 0:`` after a
boolean ``nonzero``), the trace takes the sample's branch and size, names the lines in a warning and
the plan report, and the generated program checks them: the fixture ``tests/fixtures/data_branches.py``
matches one device under dp and tp, and an input taking the other branch (or giving another size)
raises one line naming the model's line; a program with the guards dropped does not."""
from __future__ import annotations

import tempfile
import warnings

import pytest
import torch

import opzoo  # noqa: F401
from nnscaler.codegen.emit import generate
from nnscaler.compile.plan import attach_stats, choose_plan, trace_model
from nnscaler.config import ComputeConfig
from nnscaler.ir.graph import GUARD
from nnscaler.trace.build import SpecialisedBranchWarning
from tests.conftest import FIXTURES
from tests.fixtures.data_branches import IF_LINE, KEEP_LINE, SUM_LINE, Branchy, build

FILE = FIXTURES / "data_branches.py"


def _trace(model, *args):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        graph = trace_model(model, args, None, registry=None, strict=False)
    return graph, [str(w.message) for w in seen if issubclass(w.category, SpecialisedBranchWarning)]


def test_the_trace_takes_the_samples_branch_and_size_and_names_the_lines():
    model, batch = build(0)
    graph, said = _trace(model, *batch(0))
    overloads = [op.overload for op in graph.ops]
    assert "aten.relu.default" in overloads and "aten.tanh.default" not in overloads  # h.sum() > 0 on the sample
    (nonzero,) = [op for op in graph.ops if op.overload == "aten.nonzero.default"]
    assert nonzero.outputs[0].shape == (8, 1)  # every label kept: the sample's size
    guards = [op for op in graph.ops if op.overload == GUARD]
    assert any(SUM_LINE in op.source for op in guards) and any(KEEP_LINE in op.source for op in guards)
    assert any(op.kwargs["cond"] == "({0}.size(0) == 8)" and op.inputs[0] is nonzero.outputs[0] for op in guards)
    assert len(said) == 1 and all(line in said[0] for line in (SUM_LINE, KEEP_LINE, IF_LINE)), said
    assert graph.unknown() and all(op.overload != GUARD for op in graph.unknown())  # a guard is no unknown operator


def test_the_branch_is_decided_on_the_parameters_real_values():
    """torch's real-tensor propagation leaves a Parameter's real copy uninitialised (trace/branches.py):
    a branch on a layer's output was taken at random. Weights of either sign, twice each."""
    x, labels = build(0)[1](0)
    for sign in (1.0, -1.0, 1.0, -1.0):
        model = Branchy()
        with torch.no_grad():
            model.l1.weight.mul_(sign)
            model.l1.bias.fill_(sign)
        graph, _ = _trace(model, x, labels)
        taken = "aten.relu.default" if (model.l1(x).sum() > 0) else "aten.tanh.default"
        assert taken in [op.overload for op in graph.ops], sign


@pytest.mark.parametrize("policy", ["dp", "tp"])
def test_the_program_checks_each_guard_on_whole_tensors(policy):
    model, batch = build(0)
    graph, _ = _trace(model, *batch(0))
    plan = choose_plan(graph, policy, ComputeConfig(2))
    src = generate(graph, plan, 0)[0]
    body = src[src.index("def forward"):]
    asserts = [line for line in body.splitlines() if line.strip().startswith("guard(")]
    assert any(".size(0) == 8)" in a and KEEP_LINE in a for a in asserts), asserts
    assert any(".item()" in a and SUM_LINE in a for a in asserts), asserts
    attach_stats(plan, graph, ComputeConfig(2))
    report = plan.report()
    assert "data-dependent branches and sizes traced for the sample input, checked at run time: 3" in report
    assert SUM_LINE in report and KEEP_LINE in report and IF_LINE in report and "nnscaler.guard" not in report


def test_a_data_dependent_value_the_program_cannot_check_is_refused_by_name():
    """torch's real-tensor trace keeps a size made from ``int(x.sum().item() ** 0.5)`` and drops the
    ``item`` with its assertion: nothing could check it, so torch.export's own error stands."""
    from nnscaler.trace.export import TraceError

    class Odd(torch.nn.Module):
        def forward(self, x):
            n = int(x.sum().item() ** 0.5)  # a float power of a data-dependent number, then a size
            return torch.ones(n) * 2 if n > 0 else x.sum()

    with pytest.raises(TraceError) as info:
        _trace(Odd(), torch.full((4,), 4.0))
    said = str(info.value)  # torch.export's own error, as before specialising was tried
    assert "test_data_branches.py:" in said and "n = int(x.sum().item() ** 0.5)" in said, said
    assert "GuardOnDataDependentSymNode" in said and "to fix: " in said, said


# -- on ranks ---------------------------------------------------------------------------------------


def _rows(gang, name, policies, steps=2):
    from verify.config import RunConfig
    from verify.rows.run import run_model
    with tempfile.TemporaryDirectory() as tmp:
        return list(run_model(gang, f"{FILE}:{name}", policies, RunConfig(world_sizes=(2,)), tmp, steps=steps))


def test_it_matches_under_dp_and_tp_and_the_other_branch_raises_one_line_naming_the_models_line():
    from verify.judge.verdict import MATCH
    from verify.runner.gang import Gang
    with Gang(2, (), (2,)) as gang:
        good = _rows(gang, "build", ("dp", "tp"), steps=3)
        flipped = _rows(gang, "flipped", ("dp",))
        dropped = _rows(gang, "dropped", ("tp",))
    assert [r.status for r in good] == [MATCH, MATCH], [(r.status, r.detail) for r in good]
    (row,) = flipped
    assert row.status != MATCH and f"{SUM_LINE} (if h.sum() > 0:)" in row.detail, row.detail
    assert "data-dependent branch or size" in row.detail and "\n" not in row.detail.split("rank 0: ")[-1].split("rank 1")[0]
    (row,) = dropped
    assert row.status != MATCH and f"{KEEP_LINE} (keep = (labels >= 0).nonzero())" in row.detail, row.detail


def test_a_program_with_the_guards_dropped_runs_the_other_branch_silently():
    """The weaker program (``tests/fixtures/branch_guard_dropped.py``): the flipped input is not
    refused naming the line (it computes the traced branch and only the comparison sees it)."""
    from verify.runner.gang import Gang
    with Gang(2, (str(FIXTURES / "branch_guard_dropped.py"),), (2,)) as bad:
        (row,) = _rows(bad, "flipped", ("dp",))
    assert SUM_LINE not in row.detail and row.status != "match", (row.status, row.detail)


@pytest.mark.slow
def test_deberta_v2s_classifier_plans_and_matches_one_device_under_dp_and_tp():
    """Issue 41's DeBERTa-v2 (``if label_index.size(0) > 0:`` in its loss), as the zoo builds it
    (``tests/fixtures/deberta_cls.py``): traced with the guard named, MATCH under dp and tp at W=2."""
    pytest.importorskip("transformers")
    from verify.config import RunConfig
    from verify.judge.verdict import MATCH
    from verify.rows.run import run_model
    from verify.runner.gang import Gang
    from tests.fixtures.deberta_cls import build as deberta
    case = deberta(0)
    _, said = _trace(case.model, *case.batch(0))
    assert len(said) == 1 and "modeling_deberta_v2.py" in said[0] and "if label_index.size(0) > 0:" in said[0], said
    with Gang(2, (), (2,)) as gang, tempfile.TemporaryDirectory() as tmp:
        rows = list(run_model(gang, f"{FIXTURES / 'deberta_cls.py'}:build", ("dp", "tp"), RunConfig(world_sizes=(2,)),
                              tmp, steps=2))
    assert [r.status for r in rows] == [MATCH, MATCH], [(r.status, r.detail) for r in rows]


class _NanCheck(torch.nn.Module):
    """I-BERT's activation range check (``transformers/models/ibert/quant_modules.py``): a statistic
    read through ``.data`` and an ``assert`` on it (a data-dependent guard whose constant no
    operator reads)."""

    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.l(x)
        top = h.data.max()
        assert top.isnan().sum() == 0, "NaN detected"
        return h.sum()


def test_a_guard_on_a_statistic_read_through_data_is_traced_and_checked():
    """Under torch's real-tensor propagation ``.data`` became a constant holding a fake tensor and
    the assertion's constant stopped torch's constant lifting: the model was refused (I-BERT)."""
    model = _NanCheck()
    x = torch.randn(2, 4)
    graph, said = _trace(model, x)
    assert any(op.overload == GUARD for op in graph.ops) and len(said) == 1 and "top.isnan()" in said[0], said
    src = generate(graph, choose_plan(graph, "dp", ComputeConfig(2)), 0)[0]
    asserts = [line for line in src.splitlines() if line.strip().startswith("guard(")]
    assert asserts and all("top.isnan().sum() == 0" in a for a in asserts), asserts
