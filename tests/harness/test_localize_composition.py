"""Localisation of a composition fault (every operator alone right, a conversion between them wrong),
by every intermediate tensor of the program (:mod:`verify.localize.tensor_trace`).

The fault is the one issue 21 found and ``nnscaler.ir.graph.tensors_in`` fixed, put back by the
ranks' ``--module`` fixture ``tests/fixtures/tensors_in_top_level.py``: ``IROp.tensor_inputs`` reads
only an operator's top-level arguments, so keys and values passed in a list to the ``cat`` of the
speech model's key/value cache are taken to carry no gradient, and a conversion to an operator that
splits work after it leaves out the collective summing the partial gradients. The localiser must
name that very conversion (the tensor, the consumer, its layouts and steps, the gradient coming
back partial), which this process confirms by emitting the same program with and without the fault;
a correct program must localise nothing.
"""
from __future__ import annotations

import re
import tempfile
import warnings
from pathlib import Path

import pytest

from nnscaler.codegen.emit import generate
from nnscaler.compile.plan import plan_graph, trace_model
from nnscaler.ir.graph import IROp, IRTensor
from nnscaler.policies import ComputeConfig
from nnscaler.ops import DEFAULT_REGISTRY
from tests.fixtures.cat_as_before import OVERLOADS, cat_as_before
from verify.config import RunConfig
from verify.localize.model import IN_STEP_ZERO
from verify.localize.stages import BETWEEN_STAGES
from verify.rows.replicas import run_replicas
from verify.judge.verdict import MISMATCH
from verify.models.registry import MODELS
from verify.runner.gang import Gang
from verify.rows.run import run_model

FIXTURES = Path(__file__).parents[1] / "fixtures"
FAULT = str(FIXTURES / "tensors_in_top_level.py")
FORCED = str(FIXTURES / "force_localize.py")
SUMS = ("grad_all_reduce", "all_gather_sum_grad")  # the steps that sum a partial gradient



def _row(gang, model, policy, world, modules, seed=0):
    with tempfile.TemporaryDirectory() as tmp:
        (row,) = run_model(gang, model, (policy,), RunConfig(world_sizes=(world,), seeds=(seed,), modules=modules),
                           tmp, steps=1)
    return row


def _chains(source: str) -> dict[tuple[str, str], str]:
    """(tensor, reader) -> the steps of the conversion chain feeding that read, from an instrumented program."""
    steps = {m.group(1): m.group(2) for m in re.finditer(r"probe\.conversion\('([^']+)', '[^']+', \S+, '[^']+', '[^']+', "
                                                         r"\{[^}]*'steps': '([^']*)'", source)}
    return {(m.group(2), m.group(1)): steps[m.group(3)]
            for m in re.finditer(r"probe\.use\('([^']+)', \d+, '([^']+)', \S+, '[^']+', '[^']+', '([^']+)'\)", source)}


def _old_tensor_inputs(self):
    return [x for x in self.inputs if isinstance(x, IRTensor)]


def _programs(model: str, policy: str, world: int, seed: int, monkeypatch) -> tuple[dict, dict]:
    """The conversion chains of plan rank 0's program of ``model`` under ``policy``, as the compiler
    emits it now and with the fault put back (the same trace and plan, traced with the ``cat`` rule of
    the fault's time, as the ranks load it from the fixture)."""
    case = MODELS[model](seed)
    with monkeypatch.context() as m, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for overload in OVERLOADS:  # the cat rule of the fault's time, as the ranks load it
            m.setitem(DEFAULT_REGISTRY._rules, overload, [cat_as_before])
        graph = trace_model(case.model, case.batch(0), None, registry=None, strict=False)
        plan = plan_graph(graph, policy, ComputeConfig(world, tp_size=2, seed=seed))
    right = _chains(generate(graph, plan, 0, probe=True)[0])
    with monkeypatch.context() as m:
        m.setattr(IROp, "tensor_inputs", _old_tensor_inputs)
        wrong = _chains(generate(graph, plan, 0, probe=True)[0])
    return right, wrong


@pytest.fixture(scope="module")
def fault_gang(registry):  # only the ranks put the fault back: this process compiles correctly
    with Gang(2, (FAULT,), (2,)) as g:
        yield g


def _named_conversion(row) -> dict:
    assert row.status == MISMATCH, (row.status, row.detail)
    d = row.localization and row.localization["divergence"]
    assert d, row.detail
    assert (d["kind"], d["direction"]) == ("conversion", "backward"), row.detail
    assert "first divergent conversion: " in row.detail and "gradient it hands back error" in row.detail, row.detail
    assert d["err"] > d["tol"] > 0 and d["source"], d
    return d


def test_the_reintroduced_fault_is_named_at_the_conversion_that_drops_the_gradient_sum(fault_gang, monkeypatch):
    row = _row(fault_gang, "speech_encdec", "random", 2, (FAULT,))
    d = _named_conversion(row)
    right, wrong = _programs("speech_encdec", "random", 2, 0, monkeypatch)
    chain = (d["tensor"], d["op"])
    assert chain in wrong, (chain, sorted(wrong)[:10])
    # the named conversion is one the fault changed: the right program sums the gradient there, the faulty one not
    assert any(s in right[chain] for s in SUMS) and not any(s in wrong[chain] for s in SUMS), (chain, right[chain], wrong[chain])
    assert f"steps: {wrong[chain]};" in d["conversion"] and "comes back V" in d["conversion"], d["conversion"]
    assert "speech.py" in d["source"] and d["partition"] in row.detail
    # the profile runs along the program, every compared tensor, and holds the culprit beyond its bound
    prof = row.localization["profile"]
    assert len(prof) > 100 and {p[1] for p in prof} == {"F", "B"}
    assert any(p[2] > p[3] for p in prof) and all(p[2] <= p[3] for p in prof if p[1] == "F"), "forward matches"


def test_a_row_failing_after_its_resume_is_localised_on_the_plan_it_resumed_under(fault_gang, monkeypatch):
    """``through_a_list`` under ``random`` runs right; its checkpoint resumed under ``tp`` (a column-split
    linear after the list) diverges: that plan is localised, not the row's own."""
    row = _row(fault_gang, "tests/e2e/test_composition_faults.py:through_a_list", "random", 2, (FAULT,))
    assert row.detail.startswith("resumed under tp at W=2: "), row.detail
    d = _named_conversion(row)
    assert d["where"] == "plan tp at W=2, where the checkpoint was resumed" and "where the checkpoint was resumed" in row.detail


@pytest.fixture(scope="module")
def forced_gang(registry):  # every model case fails one extra check: correct programs get localised
    with Gang(2, (FORCED,), (2,)) as g:
        yield g


@pytest.mark.parametrize("policy", ["random", "dp"])
def test_a_correct_program_localises_nothing(forced_gang, policy):
    row = _row(forced_gang, "speech_encdec", policy, 2, (FORCED,))
    assert row.status == MISMATCH and row.detail.endswith(IN_STEP_ZERO), row.detail
    loc = row.localization
    assert loc["divergence"] is None and loc["note"] == IN_STEP_ZERO
    assert loc["profile"] and all(p[2] <= p[3] for p in loc["profile"]), max(loc["profile"], key=lambda p: p[2] / p[3])


@pytest.fixture(scope="module")
def fault_gang4(registry):
    with Gang(4, (FAULT,), (4,)) as g:
        yield g


def test_the_fault_in_a_pipeline_stage_is_named_with_its_stage(fault_gang4):
    row = _row(fault_gang4, "speech_encdec", "pp2_random", 4, (FAULT,))
    d = _named_conversion(row)
    assert re.fullmatch(r"stage \d of 2 \(ranks \d-\d\)", d["where"]), d["where"]
    assert BETWEEN_STAGES not in row.detail
    assert all(p[0].startswith(("s0:", "s1:")) for p in row.localization["profile"])


@pytest.mark.slow  # the pipeline test above keeps W=4 localisation in the default suite
def test_the_fault_in_replicas_is_named_on_their_plan_ranks(fault_gang4):
    with tempfile.TemporaryDirectory() as tmp:
        (row,) = run_replicas(fault_gang4, "speech_encdec", ("random",), RunConfig(world_sizes=(4,), modules=(FAULT,)),
                              tmp, 2, steps=1)
    d = _named_conversion(row)
    assert d["where"] == "the plan alone on 2 of 4 ranks", d["where"]
