"""Every rerun line a mismatching row prints runs as printed (issue 21, item 5): the command in the
rerun column of an operator row and of a model row, and the ``alone:`` line of a localised model row,
for a rule-based (ATen) operator (``verify op --model M --node N``) and for a registered one
(``verify op NAME``), each with the ``--dtype``, ``--seed`` and ``--module`` files it needs. Each runs
in a fresh process, from the repository root, exactly as printed, and must reproduce its mismatch
(exit 1, never 2: an unknown operator or a missing module is bad input)."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from verify.config import RunConfig
from verify.judge.verdict import MISMATCH
from verify.runner.gang import Gang
from verify.rows.run import run_model, run_op

FIXTURES = Path(__file__).parents[1] / "fixtures"
ROOT = Path(__file__).parents[2]
WRONG_RULES = str(FIXTURES / "wrong_norm_rules.py")
WRONG_OPS = str(FIXTURES / "wrong_ops.py")
SPLIT_NORM = f"{FIXTURES / 'rerun_policies.py'}:split_norm"
OP_HANDLE = FIXTURES / "op_handle_model.py"
OP_HANDLE_POLICY = f"{FIXTURES / 'op_handle_policy.py'}:split_h"


def printed(rows) -> list[str]:
    """Every command the rows print: each rerun column, and the ``alone:`` line that ends a detail."""
    out = []
    for r in rows:
        assert r.status == MISMATCH, (r.op, r.partition, r.status, r.detail)
        out.append(r.rerun)
        alone = re.search(r"; alone: (python -m verify op .*)$", r.detail)
        if alone:
            out.append(alone.group(1))
    return list(dict.fromkeys(c for c in out if c))


def runs_as_printed(command: str) -> None:
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "verify"], command
    done = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 1 and "MISMATCH" in done.stdout, (command, done.returncode, done.stderr[-2000:],
                                                                done.stdout[-2000:])


@pytest.fixture(scope="module")
def rules_gang(registry):  # the wrong rules poison every model: a gang of their own, as `--module` gives one
    with Gang(2, (WRONG_RULES,), (2,)) as g:
        yield g


def _norm_row(gang):
    cfg = RunConfig(world_sizes=(2,), modules=(WRONG_RULES,))
    with tempfile.TemporaryDirectory() as tmp:
        (row,) = run_model(gang, "nanogpt", (SPLIT_NORM,), cfg, tmp, steps=1)
    return row


def test_a_localised_rule_based_operators_alone_line_runs_as_printed(rules_gang):
    row = _norm_row(rules_gang)
    (model, alone) = printed([row])
    argv = shlex.split(alone)
    assert argv[4:6] == ["--model", "nanogpt"] and argv[6] == "--node" and argv[7].startswith("layer_norm"), alone
    for flag, value in (("--dtype", "float32"), ("--seed", "0"), ("--module", WRONG_RULES), ("--world-size", "2")):
        assert argv[argv.index(flag) + 1] == value, alone
    assert model.startswith("python -m verify model nanogpt --policy ") and f"--module {WRONG_RULES}" in model
    runs_as_printed(alone)


@pytest.mark.slow
def test_every_rerun_line_printed_runs_as_printed(rules_gang, registry):
    """Operator rows of a wrong operator, and model rows whose culprit is a rule-based operator and a
    registered operator of the model's own file: every line, each in a fresh process."""
    cfg = RunConfig(world_sizes=(2,), modules=(WRONG_OPS,))
    with Gang(2, (WRONG_OPS,), (2,)) as g, tempfile.TemporaryDirectory() as tmp:
        ops = [r for r in run_op(g, registry.get("wrong_softmax"), cfg) if r.status != "match"]
        (user,) = run_model(g, f"{OP_HANDLE}:build_wrong", (OP_HANDLE_POLICY,), RunConfig(world_sizes=(2,)), tmp,
                            steps=1)
    lines = printed(ops + [_norm_row(rules_gang), user])
    assert any(f"--module {OP_HANDLE}" in c and " op ophandle_scaled_gelu_wrong " in c for c in lines), lines
    assert len(lines) == len(ops) + 4, lines
    for command in lines:
        runs_as_printed(command)
