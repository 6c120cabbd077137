"""The harness mutant catalogue (``tests/mutants/harness``) is well formed: at least 40 mutants, each one
applies (its target exists) and is undone cleanly, and each names killing tests that exist (a file of
``tests/`` defining that test function, a parametrised id of a parametrised test)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mutants.harness import HARNESS, applied
from tests.mutants.harness_run import command
from tests.mutants.harness_plugin import shim

ROOT = Path(__file__).resolve().parents[2]


def test_the_catalogue_holds_at_least_40_mutants():
    assert len(HARNESS) >= 40


@pytest.mark.parametrize("name", list(HARNESS))
def test_every_mutant_applies_and_is_undone(name):
    from verify.judge import compare
    before = compare.check_tensor, compare.UPDATE_EPS
    with applied(name):
        pass
    assert (compare.check_tensor, compare.UPDATE_EPS) == before


def _defines(path: Path, func: str) -> bool:
    names = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return func in names


@pytest.mark.parametrize("name", list(HARNESS))
def test_every_mutant_names_killing_tests_that_exist(name):
    m = HARNESS[name]
    assert m.kills and m.target and m.why
    file, _, what = m.target.partition(":")
    assert (ROOT / file).is_file() and what, m.target
    for node in m.kills:
        path, _, func = node.partition("::")
        assert (ROOT / path).is_file(), node
        assert _defines(ROOT / path, func.split("[")[0].split("::")[-1]), node


def test_the_runner_applies_the_mutant_in_pytest_and_in_every_rank(tmp_path):
    cmd = command("loss_unchecked", ("tests/harness/test_harness_rules.py::test_a_wrong_loss_fails",))
    assert cmd[1:3] == ["-m", "pytest"] and "tests.mutants.harness_plugin" in cmd
    assert cmd[cmd.index("--harness-mutant") + 1] == "loss_unchecked"
    text = shim(tmp_path, "loss_unchecked").read_text()
    assert "apply('loss_unchecked')" in text


def test_every_killing_test_is_collected():
    """Every named node id (parametrised ids included) is one pytest collects."""
    nodes = sorted({k for m in HARNESS.values() for k in m.kills})
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", "-p",
                          "no:cacheprovider", *nodes], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
