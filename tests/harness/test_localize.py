"""A mismatching whole-model case names the first operator whose output or gradient diverges, with
its source line, its partition and the command that verifies it alone (wrong annotations inside
nanoGPT, Llama and a user's model), or the conversion between operators that diverges (a wrong
collective injected into the runtime)."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

from nnscaler.codegen.emit import generate
from nnscaler.policies import POLICIES, ComputeConfig
from nnscaler.trace.build import trace
from tests.conftest import first_mismatch
from verify.judge.verdict import MISMATCH
from verify.config import RunConfig
from verify.rows.run import run_model
from verify.runner.gang import Gang
from verify.models.registry import MODELS

FIXTURES = Path(__file__).parents[1] / "fixtures"
ROOT = Path(__file__).parents[2]
WRONG_RULES = str(FIXTURES / "wrong_norm_rules.py")
WRONG_COLLECTIVE = str(FIXTURES / "wrong_collective.py")


def _row(gang, model: str, policy: str, seed: int, modules=()):
    cfg = RunConfig(world_sizes=(2,), seeds=(seed,), modules=tuple(modules))
    with tempfile.TemporaryDirectory() as tmp:
        (row,) = run_model(gang, model, (policy,), cfg, tmp, steps=1)
    return row


def test_a_wrong_custom_op_in_a_user_model_is_named(gang, registry):
    row = _row(gang, "wrong_softmax_head", "tp", 0)
    assert row.status == MISMATCH
    assert "first divergent operator: row_softmax" in row.detail and "registered as wrong_row_softmax" in row.detail
    assert "wrong_model.py:37: return ((row_softmax(self.proj(x)) - y) ** 2).mean()" in row.detail
    assert "alone: python -m verify op wrong_row_softmax --world-size 2 --partition b=2" in row.detail


def _wrong_splits(model: str, overloads: tuple[str, ...]):
    """(seed, op) for each ``random`` plan at W=2 (seeds 0..19) that splits the normalised (last) dim
    of one of ``overloads``: the first such op in program order is the expected culprit."""
    for seed in range(20):
        case = MODELS[model](seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = trace(case.model, case.batch(0))
        plan = POLICIES["random"](graph, ComputeConfig(2, seed=seed))
        for op in graph.ops:
            if op.overload in overloads and op.known and plan.partition(op).factor(op.bound.inputs[0][-1][0]) > 1:
                yield seed, op
                break


@pytest.fixture(scope="module")
def wrong_rules_gang(wrong_norm_rules):
    with Gang(2, [wrong_norm_rules], (2,)) as g:
        yield g


@pytest.mark.parametrize("model,overloads", [("nanogpt", ("aten.layer_norm.default",)),
                                             ("llama", ("aten.softmax.int", "aten._softmax.default"))])
def test_a_wrong_annotation_inside_a_model_is_named(wrong_rules_gang, model, overloads):
    if model not in MODELS:
        pytest.skip("needs transformers")
    # the first seed whose program runs and mismatches (some wrong splits error: also a failure)
    (seed, culprit), row = first_mismatch(_wrong_splits(model, overloads),
                                          lambda c: _row(wrong_rules_gang, model, "random", c[0], [WRONG_RULES]))
    found = re.search(r"first divergent operator: (\S+) \(([^)]*)\) \[([^\]]*)\]", row.detail)
    assert found, row.detail
    assert found.group(1) == culprit.name and found.group(2).startswith(culprit.overload), (row.detail, culprit)
    assert culprit.source and culprit.source in row.detail  # the model's own line
    if model == "nanogpt":  # the printed command reruns that very operator alone, at the model's shapes
        _rerun_reproduces(row.detail, culprit.name, seed)


def _rerun_reproduces(detail: str, node: str, seed: int) -> None:
    """The ``alone:`` command fails (exit 1, MISMATCH) under the wrong rules; the same node under the
    right annotation (no --module, every partition it admits) passes."""
    found = re.search(r"; alone: (python -m verify op .*)$", detail)
    assert found, detail
    argv = shlex.split(found.group(1))
    assert ["--model", "nanogpt", "--node", node] == argv[4:8], argv
    assert all(f in argv for f in ("--partition", "--world-size", "--dtype", "--seed", "--module")), argv
    assert argv[argv.index("--seed") + 1] == str(seed) and argv[argv.index("--module") + 1] == WRONG_RULES, argv
    wrong = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert wrong.returncode == 1 and "MISMATCH" in wrong.stdout, wrong.stdout[-2000:] + wrong.stderr[-2000:]
    cut = argv.index("--module")
    right = [a for i, a in enumerate(argv[1:cut], 1) if a != "--partition" and argv[i - 1] != "--partition"]
    ok = subprocess.run([sys.executable, *right], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert ok.returncode == 0 and "MISMATCH" not in ok.stdout, ok.stdout[-2000:] + ok.stderr[-2000:]


def test_verify_op_of_a_model_node_refuses_unknown_nodes():
    r = subprocess.run([sys.executable, "-m", "verify", "op", "--model", "nanogpt", "--node", "linar_3"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "no operator 'linar_3'; closest: linear_3" in r.stderr, r.stderr


def test_a_wrong_collective_is_named_as_the_conversion_into_the_operator_that_consumes_it():
    case = MODELS["nanogpt"](0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(case.model, case.batch(0))
    plan = POLICIES["tp"](graph, ComputeConfig(2))
    source, _, _ = generate(graph, plan, 0)
    lines = source.splitlines()
    outputs = {t.name: op.name for op in graph.ops for t in op.outputs if t is not None}
    at = next(i for i, line in enumerate(lines) if "C.all_reduce(" in line)
    var, expected = lines[at].split("=")[0].strip(), None
    for line in lines[at + 1:]:  # follow further conversions of the gathered tensor to the op consuming it
        if "=" in line and re.search(rf"\b{re.escape(var)}\b", line.split("=", 1)[1]):
            lhs = line.split("=")[0].strip().split(",")[0].strip()
            if lhs in outputs:
                expected = outputs[lhs]
                break
            var = lhs
    assert expected is not None, source
    summed = re.search(r"C\.all_reduce\((\w+?)(?:__\d+)?, ", lines[at]).group(1)  # the tensor the all-reduce sums
    with Gang(2, [WRONG_COLLECTIVE], (2,)) as g:
        row = _row(g, "nanogpt", "tp", 0, [WRONG_COLLECTIVE])
    assert row.status == MISMATCH
    # every operator matches: the conversion that sums the partial value, into its consumer, is named
    assert f"first divergent conversion: {summed} V -> R for {expected} input " in row.detail, (expected, row.detail)
    assert "steps: all_reduce(axis 0)" in row.detail and f"into {expected} (" in row.detail, row.detail
    assert "value after it error" in row.detail, row.detail
    assert row.localization["divergence"]["kind"] == "conversion", row.localization
