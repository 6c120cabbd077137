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
    assert result.parseoutcomes().get("passed") == 2, summary


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
