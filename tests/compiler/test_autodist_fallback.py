"""autodist never gives up where a plan exists: an LSTM language model (whose fused layer's cost once
overflowed HiGHS's infinity, status 'Unknown') plans and matches one device; a solver stopped short of
optimal takes the greedy plan of that mesh, or the dp/tp plan that fits, and says which and why; the
integer program's size and solve time per mesh are in the plan report."""
from __future__ import annotations

import importlib
import math
import sys
import warnings
from pathlib import Path

import pytest

import opzoo  # noqa: F401
from nnscaler import ComputeConfig, PlanError
from nnscaler.compile.plan import PlanWarning, canonical_params, plan_graph
from nnscaler.trace.build import trace
from verify.judge.verdict import MATCH

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
sys.path.insert(0, str(FIXTURES))
from lstm_lm import build  # noqa: E402

search = importlib.import_module("nnscaler.policies.autodist")  # the module (the package exports the function)


def _lstm_graph():
    model, batch = build(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = trace(model, batch(0))
    canonical_params(model, g)
    return g


@pytest.mark.parametrize("world", [2, 4])
def test_the_lstm_lm_plans_by_the_solver_with_its_program_size_in_the_report(world):
    g = _lstm_graph()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanWarning)  # no fallback: HiGHS solved every mesh
        plan = plan_graph(g, "autodist", ComputeConfig(world))
    assert "stopped short" not in plan.note and "fell back" not in plan.note, plan.note
    report = plan.report()
    assert report.count(" variables, ") == len(search.meshes(world)) and " constraints, " in report, report


def test_a_fused_recurrent_layer_costs_what_its_matrices_do():
    """2 FLOPs per token per weight of its matrices: not the product of every identifier of its
    annotation (1e22 s, over HiGHS's infinity)."""
    from nnscaler.cost.compute import op_flops
    (lstm,) = [op for op in _lstm_graph().ops if op.overload == "aten.lstm.input"]
    flops, _ = op_flops(lstm, None)
    tokens, width = 8 * 12, 32
    assert flops == 2 * tokens * 2 * (4 * width * width + 4 * width * width)


def test_the_lstm_lm_under_autodist_matches_one_device(verify_model):
    rows = verify_model(f"{FIXTURES / 'lstm_lm.py'}:build", policies=["autodist"], world_sizes=[2], steps=2)
    assert [r.status for r in rows] == [MATCH], rows


def test_a_solver_stopped_at_its_time_limit_falls_back_to_the_greedy_plan_and_says_so():
    g = _lstm_graph()
    with pytest.warns(PlanWarning, match=r"HiGHS stopped short of optimal without a usable plan \(status 'Time limit "
                                         r"reached'\): the greedy plan on this mesh instead"):
        plan = search.autodist(g, ComputeConfig(2), time_limit=0.0)
    assert "greedy plan, " in plan.note and "the chosen mesh's plan: HiGHS stopped short" in plan.note, plan.note
    assert plan_graph(g, lambda graph, config: plan, ComputeConfig(2)).world_size == 2  # a valid plan


def test_where_no_mesh_has_a_plan_the_dp_or_tp_plan_that_fits_is_taken_and_said(monkeypatch):
    """Every mesh stopped with nothing usable (the greedy plans not costed): the faster of dp and tp."""
    g = _lstm_graph()
    monkeypatch.setattr(search, "short_of_optimal", lambda graph, prog, sol, batch, budget: sol)
    with pytest.warns(PlanWarning, match="HiGHS stopped short of optimal without a plan on every mesh; fell back to "
                                         "the (dp|tp) plan"):
        plan = search.autodist(g, ComputeConfig(2), time_limit=0.0)
    assert plan.policy == "autodist" and "fell back to the" in plan.note and "Time limit reached" in plan.note


def test_a_budget_nothing_fits_is_still_refused_with_the_smallest_memory():
    g = _lstm_graph()
    with pytest.raises(PlanError, match=r"no plan on 2 ranks fits mem_budget=1\.0 KiB.*smallest per-rank memory"):
        search.autodist(g, ComputeConfig(2, mem_budget=1024))


def test_costs_over_highs_infinity_are_capped_not_unknown():
    """A cost the model overestimates past 1e20 ms would read as infinite to HiGHS: capped, it still solves."""
    g = _lstm_graph()
    batch = search.batch_identifiers(g)
    classes, of = search.op_classes(g, batch, search.fused_blocks(g))
    prog = search.build_program(g, classes, of, (2,), ("dp",), search.axis_options(("dp",), batch),
                                search.get_profile("cpu-gloo"))
    prog.seconds[0] = prog.seconds[0] + 1e30
    sol = search.solve(prog, None, search.TIME_LIMIT)
    assert sol.status == "Optimal" and sol.choice is not None and not math.isinf(sol.seconds), sol


@pytest.mark.parametrize("status, stopped", [("Unknown", True), ("Time limit reached", True),
                                             ("Solution limit reached", True), ("infeasible", False),
                                             ("no faster plan (bound 1.2 ms)", False), ("Objective bound", False)])
def test_only_a_stop_short_of_a_proof_falls_back(status, stopped):
    """A mesh proven infeasible or beaten by another mesh's plan keeps no plan; only a stop falls back."""
    assert search.Solution((2,), ("dp",), status).stopped == stopped
