"""A program per branch of the model's state (issue 41 item 3, I-BERT's ``QuantAct``): a guard that reads
the model's state alone (``if self.lo.abs().max() < 1e-6:`` on a buffer, true at step 1, false after)
makes the module trace, plan and load the program of the other branch on the same parameters when it
fails (``nnscaler/compile/respecialise.py``), said once and counted in the plan report; the model of
``tests/fixtures/state_branch.py`` then trains equal to one device under dp and tp (micro-batches too),
and a program that keeps the old branch is caught. A guard on the input still raises, and data-parallel
replicas whose inputs take different sides of it all raise one line naming it (none hangs)."""
from __future__ import annotations

import tempfile
import warnings

import torch

import opzoo  # noqa: F401
from nnscaler.codegen.emit import generate
from nnscaler.compile.plan import choose_plan, trace_model
from nnscaler.config import ComputeConfig
from nnscaler.ir.graph import GUARD
from tests.conftest import FIXTURES
from tests.fixtures.data_branches import build as data_branches
from tests.fixtures.state_branch import INPUT_LINE, STATE_LINE, build

FILE = FIXTURES / "state_branch.py"


def _trace(model, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace_model(model, args, None, registry=None, strict=False)


def test_a_guard_on_the_state_alone_is_told_from_one_on_the_input():
    graph = _trace(*(lambda m, b: (m, *b(0)))(*build(0)))
    guards = [op for op in graph.ops if op.overload == GUARD]
    assert guards and all(op.kwargs["on_state"] and STATE_LINE in op.source for op in guards)
    assert all("traced for a model state where" in op.kwargs["message"] for op in guards)
    model, batch = data_branches(0)  # ``if h.sum() > 0:`` on a layer of the input: on data
    graph = _trace(model, *batch(0))
    assert [op for op in graph.ops if op.overload == GUARD] and not any(
        op.kwargs["on_state"] for op in graph.ops if op.overload == GUARD)
    src = generate(graph, choose_plan(graph, "dp", ComputeConfig(2)), 0)[0]
    assert "from nnscaler.runtime.program import guard" in src and "on_state=False)" in src


def test_a_plan_holding_state_as_told_emits_those_pieces_and_no_bucket_sync_of_a_split():
    """``Plan.held``: the respecialised program holds each tensor as its predecessor did."""
    model, batch = build(0)
    graph = _trace(model, *batch(0))
    plan = choose_plan(graph, "tp", ComputeConfig(2))
    _, shards, _ = generate(graph, plan, 1)
    first = {s.name: s for s in shards}
    flip = {n: ("R",) if s.layout[0].startswith("D") else ("D0",) for n, s in first.items()
            if n in ("l2.bias", "act.lo")}
    plan.held = flip
    _, shards, _ = generate(graph, plan, 1)
    now = {s.name: s for s in shards}
    for n, lay in flip.items():
        assert now[n].layout == lay, (n, now[n])
        if lay == ("D0",):
            assert now[n].slices == ((32, 64),) and now[n].sync_axis is None, now[n]


# -- on ranks ---------------------------------------------------------------------------------------


def _rows(gang, name, policies, steps=3, **cfg):
    from verify.config import RunConfig
    from verify.rows.run import run_model
    with tempfile.TemporaryDirectory() as tmp:
        return list(run_model(gang, f"{FILE}:{name}", policies, RunConfig(world_sizes=(2,), **cfg), tmp,
                              steps=steps))


def test_the_state_branch_trains_equal_to_one_device_under_dp_and_tp_and_a_kept_branch_is_caught():
    """Three AdamW steps (the branch flips at the second), each buffer compared after every step, the
    checkpoint reloaded under another plan (whose program, traced on a fresh model, respecialises too);
    then the weaker program (``tests/fixtures/respecialise_dropped.py``: state guards never fail, the
    step-1 branch is kept) is a MISMATCH."""
    from verify.judge.verdict import MATCH, MISMATCH
    from verify.runner.gang import Gang
    with Gang(2, (), (2,)) as gang:
        rows = _rows(gang, "build", ("dp", "tp"))
        rows += _rows(gang, "build", ("tp",), microbatches=2)
    assert [r.status for r in rows] == [MATCH] * 3, [(r.partition, r.status, r.detail) for r in rows]
    with Gang(2, (str(FIXTURES / "respecialise_dropped.py"),), (2,)) as bad:
        rows = _rows(bad, "build", ("dp", "tp"), steps=2)
    assert [r.status for r in rows] == [MISMATCH] * 2, [(r.partition, r.status, r.detail) for r in rows]
    assert all("after step 1" in r.detail or "step 1" in r.detail for r in rows), [r.detail for r in rows]


def test_a_pipeline_stage_whose_state_guard_fails_refuses_naming_the_line():
    """Pipeline stages are traced once: the second step raises on every rank, naming the line and why."""
    from verify.judge.verdict import MATCH
    from verify.runner.gang import Gang
    with Gang(2, (), (2,)) as gang:
        (row,) = _rows(gang, "build", ("pp",), steps=2)
    assert row.status != MATCH and STATE_LINE in row.detail, (row.status, row.detail)
    assert "a pipeline stage's program is traced once" in row.detail, row.detail


def test_replicas_whose_inputs_take_different_sides_of_a_data_branch_all_raise_naming_the_line():
    from verify.config import RunConfig
    from verify.rows.replicas import run_replicas
    from verify.runner.gang import Gang
    with Gang(2, (), (2,)) as gang, tempfile.TemporaryDirectory() as tmp:
        (row,) = run_replicas(gang, f"{FILE}:on_input", ("dp",), RunConfig(world_sizes=(2,)), tmp, 2, steps=2)
    assert row.status != "match", (row.status, row.detail)
    assert row.detail.count(INPUT_LINE) >= 2 and "another data-parallel replica" in row.detail, row.detail
    assert "rank 0" in row.detail and "rank 1" in row.detail and "timed out" not in row.detail, row.detail


def test_the_respecialised_module_keeps_its_parameters_and_counts_the_branch_in_its_report(one_rank):
    """In one process (a plan of one rank): the same Parameter objects before and after, one program per
    branch kept (the third step runs the second program without tracing again), the warning said once,
    the report's count; the single-device model left as it was."""
    from nnscaler import parallelize
    from nnscaler.compile.respecialise import RespecialisedWarning
    model, batch = build(0)
    ref, _ = build(0)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pm = parallelize(model, batch(0), "dp", ComputeConfig(1), gen_savedir=tmp, verify=False)
        params = list(pm.parameters())
        opt = torch.optim.SGD(pm.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        first = pm._program
        for step in range(3):
            for m, o in ((pm, opt), (ref, ref_opt)):
                o.zero_grad()
                m(*batch(step)).backward()
                o.step()
        said = [w for w in seen if issubclass(w.category, RespecialisedWarning)]
        report = (tmp + "/plan_report.txt")
        text = open(report).read()
    assert list(pm.parameters()) == params and all(a is b for a, b in zip(pm.parameters(), params))
    assert pm._program is not first and len(pm._branches) == 1 and len(said) == 1, (pm._branches, said)
    assert STATE_LINE in str(said[0].message), said[0].message
    assert "programs respecialised at run time, a guard on the model's state having failed: 1" in text
    assert STATE_LINE in text.split("programs respecialised")[1]
    whole = pm.state_dict()
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(whole[name], want, rtol=1e-5, atol=1e-6, msg=name)
    assert model.act.lo.abs().max() == 0  # the model handed to parallelize is left as it was


class _Parity(torch.nn.Module):
    """A branch on a step counter's parity: it flips at every step."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps.add_(1)
        h = self.lin(x)
        if self.steps % 2 == 1:
            h = h * 2
        return h.pow(2).mean()


def test_a_branch_flipping_every_step_is_traced_once_per_branch(one_rank):
    """Programs are kept per (program, failed guard): after each branch was made once, flipping back and
    forth traces nothing (``Respecialiser.made``), and the losses are the single-device model's."""
    from nnscaler import parallelize
    model, ref = _Parity(), _Parity()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(4, 8)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = parallelize(model, (x,), "dp", ComputeConfig(1), gen_savedir=tmp, verify=False)
        programs = set()
        for _ in range(6):
            torch.testing.assert_close(pm(x), ref(x))
            programs.add(pm._program.__name__)
    assert len(programs) == 2 and pm.respecialise.made == 2, (programs, pm.respecialise.made)
    assert int(pm.state_dict()["steps"]) == 6
