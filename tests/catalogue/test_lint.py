"""Annotation lint: every known-wrong annotation of the fixtures is flagged with its fix, before any
rank runs; no operator of the zoo (hand-written entries and rule examples) is flagged."""
from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

import opzoo  # noqa: F401
from nnscaler import DEFAULT_REGISTRY, OpRegistry, register_op
from nnscaler.ops.lint import AnnotationWarning
from verify.lint import lint, lint_dynamic

WRONG = {"wrong_softmax": ("mixes", "b^"), "wrong_sum_spatial": ("consumed", "b+"), "wrong_mean_value":
         ("not-additive", "b^"), "wrong_flip": ("mixes", "b^"), "wrong_cumsum": ("mixes", "b^")}


@pytest.mark.parametrize("name", sorted(WRONG))
def test_wrong_annotations_are_flagged_with_the_fix(registry, name):
    (finding,) = lint([registry.get(name)])
    kind, fix = WRONG[name]
    assert finding.kind == kind and f"'{fix}'" in finding.message, finding


def test_no_zoo_operator_is_flagged():
    zoo = [s for s in DEFAULT_REGISTRY if not s.family.startswith("test") and s.family != "inferred"]
    assert len(zoo) > 300
    assert lint(zoo) == []


@pytest.mark.parametrize("dim", [0, 1])
def test_a_window_op_is_caught_on_the_dim_it_slides_over(dim):
    reg = OpRegistry()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AnnotationWarning)
        register_op("a b -> a b", "roll", registry=reg, kwargs={"shifts": 1, "dims": dim})(torch.roll)
    (finding,) = lint_dynamic(reg.get("roll"))
    assert finding.ident == "ab"[dim] and finding.kind == "mixes"


def test_register_op_warns_at_once():
    with pytest.warns(AnnotationWarning, match="'k\\+' if the op adds over it"):
        register_op("m k, k n -> m n", "lint_probe_matmul", registry=OpRegistry())(torch.matmul)


def test_cli_lint_exit_codes(tmp_path):
    ops = tmp_path / "ops.py"
    ops.write_text("import torch\nfrom nnscaler import register_op\n"
                   "register_op('a b -> a b', 'my_softmax', kwargs={'dim': 1})(torch.softmax)\n"
                   "register_op('a b -> a b', 'my_exp')(torch.exp)\n")
    run = lambda *a: subprocess.run([sys.executable, "-m", "verify", "lint", *a], capture_output=True, text=True)
    bad = run("my_softmax", "--module", str(ops))
    assert bad.returncode == 1 and "my_softmax" in bad.stdout and "'b^'" in bad.stdout
    good = run("my_exp", "--module", str(ops))
    assert good.returncode == 0 and "0 findings" in good.stdout
    unknown = run("nope", "--module", str(ops))
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1


@pytest.mark.parametrize("sizes, flagged", [({"b": 1}, False), ({}, True), ({"b": 2}, True)])
def test_a_consumed_dim_is_flagged_unless_its_length_is_fixed_at_one(sizes, flagged):
    """nnScaler's squeeze ``a b c -> a c`` with ``b`` of length 1 is right: no split of b exists."""
    reg = OpRegistry()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", AnnotationWarning)
        register_op("a b c -> a c", "sq", registry=reg, kwargs={"dim": 1}, sizes=sizes)(torch.squeeze if sizes.get("b") == 1 else torch.sum)
    assert any(issubclass(w.category, AnnotationWarning) for w in seen) == flagged


def test_a_diagonal_identifier_is_not_flagged():
    """``l l -> 1`` (a trace): the grammar never splits an identifier repeated in one tensor."""
    reg = OpRegistry()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", AnnotationWarning)
        register_op("l l -> 1", "tr", registry=reg)(torch.trace)
    assert not [w for w in seen if issubclass(w.category, AnnotationWarning)]
