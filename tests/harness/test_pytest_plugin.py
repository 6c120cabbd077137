"""The pytest plugin in a user's own suite: a ten-line test file verifies an operator and a model,
one subtest per (world size, partition or policy, seed); a wrong annotation fails with the rerun line."""
from __future__ import annotations

import importlib.metadata
import shutil
from pathlib import Path

pytest_plugins = ["pytester"]

USER_TESTS = '''
import torch
from nnscaler import register_op

@register_op("b m k+, k+ n -> b m n")
def my_matmul(x, w):
    return x @ w

def test_my_matmul(verify_op):
    verify_op(my_matmul)

@register_op("b m k, k n -> b m n", "my_wrong_matmul")
def my_wrong_matmul(x, w):
    return x @ w

def test_my_wrong_matmul(verify_op):
    verify_op(my_wrong_matmul)

def test_user_model(verify_model):
    verify_model("user_model.py:build", policies=["dp"])

def test_user_model_recipe(verify_model):
    from nnscaler.recipe import Recipe
    rows = verify_model("user_model.py:build", policies=["dp"], steps=2, recipe=Recipe(zero=1), clip_grad_norm=1.0)
    assert [r.partition for r in rows] == ["dp zero1 clip1"], [r.partition for r in rows]

def test_wrong_model(verify_model):
    verify_model("wrong_model.py:wrong_softmax_head", policies=["tp"], steps=1)
'''


def _plugin_args() -> list[str]:
    installed = any(ep.value == "verify.pytest_plugin" for ep in importlib.metadata.entry_points(group="pytest11"))
    return [] if installed else ["-p", "verify.pytest_plugin"]


def test_user_suite_reports_one_subtest_per_row(pytester):
    pytester.makepyfile(test_user=USER_TESTS)
    for f in ("user_model.py", "wrong_model.py"):
        shutil.copy(Path(__file__).parents[1] / "fixtures" / f, pytester.path / f)
    result = pytester.runpytest_subprocess(*_plugin_args(), "--verify-world-size", "2", "-p", "no:cacheprovider",
                                           "-W", "ignore::UserWarning", timeout=600)
    out = result.stdout.str()
    summary = out.split("short test summary")[-1]
    # the wrong matmul fails only where its spatial-marked contraction k is split, with the rerun line
    assert "SUBFAILED[W=2 k=2 seed=0] test_user.py::test_my_wrong_matmul" in summary, out[-3000:]
    assert "rerun: python -m verify op my_wrong_matmul --world-size 2 --partition k=2" in out, out[-3000:]
    assert "W=2 m=2" not in summary and "W=2 replicate" not in summary, summary
    # a model that mismatches fails its subtest, naming the divergent operator and the rerun line
    assert "SUBFAILED[W=2 tp seed=0] test_user.py::test_wrong_model" in summary, out[-3000:]
    assert "first divergent operator: row_softmax" in out and "rerun: python -m verify model" in out, out[-3000:]
    # the right matmul and the user's model pass
    assert "test_my_matmul" not in summary and "test_user_model" not in summary, summary
    assert result.parseoutcomes().get("passed") == 3, summary  # test_user_model_recipe too: ZeRO 1 and clipping


def test_verify_model_takes_a_recipe_or_its_fields_as_the_cli_takes_flags():
    import pytest
    from nnscaler.recipe import Recipe
    from verify.pytest_plugin import model_recipe
    assert model_recipe(None, 1, {}, ("dp",), (2,)) == Recipe()
    got = model_recipe(Recipe(zero=1, precision="bf16-mixed"), 2, {"zero": 2, "recompute": "full"}, ("dp",), (2, 4))
    assert got == Recipe(num_microbatches=2, zero=2, precision="bf16-mixed", recompute="full")  # keywords win
    with pytest.raises(TypeError, match="'zeros'.*recipe fields: precision, zero"):
        model_recipe(None, 1, {"zeros": 1}, ("dp",), (2,))
    with pytest.raises(ValueError, match="zero must be 0, 1, 2 or 3"):
        model_recipe(None, 1, {"zero": 5}, ("dp",), (2,))
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        model_recipe(None, 1, {"precision": "fp8"}, ("dp",), (2,))
    with pytest.raises(ValueError, match="--zero 1"):  # tp has no data-parallel ranks to shard over
        model_recipe(None, 1, {"zero": 1}, ("tp",), (2,))
    with pytest.raises(ValueError, match="leave dtype at float32"):
        model_recipe(None, 1, {"precision": "bf16-mixed"}, ("dp",), (2,), dtype="float64")


def test_the_plugin_is_installed_as_an_entry_point():
    eps = [ep for ep in importlib.metadata.entry_points(group="pytest11") if ep.value == "verify.pytest_plugin"]
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert 'nnscaler_verify = "verify.pytest_plugin"' in pyproject
    assert eps, "pip install -e . registers the plugin under pytest11"


def test_the_main_job_install_pulls_what_the_plugin_needs():
    """``pip install -e '.[models]'`` (the README's main job) brings pytest with its built-in subtests."""
    import tomllib
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert "pytest>=9" in project["optional-dependencies"]["models"]
