"""The verdict cache: a unit's verdict is reused until something it depends on changes (its family's
file, a rule for an operator of its graphs, any core file, a new claim on one of its operators); a
failure is never kept; a cached row says so in every report. And shards merge into one report."""
from __future__ import annotations

import json
import shutil
from dataclasses import fields, replace
from pathlib import Path

import pytest

from nnscaler.recipe import Recipe

from verify.sweep.cache import ROOT, Used, VerdictCache
from verify.config import RunConfig
from verify.judge.row import Row
from verify.cli import main
from verify.sweep.selection import Unit
from verify.runner.worker import load_modules


@pytest.fixture
def tree(tmp_path):
    """A copy of the sources the cache keys on, to edit."""
    for pkg in ("nnscaler", "verify", "opzoo"):
        shutil.copytree(ROOT / pkg, tmp_path / "src" / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "src"


def _row(op="relu", status="match", family="activation"):
    return Row(op, family, "a -> a", 2, "a=2", "float32", 0, status, seconds=1.5)


def _cache(tmp_path, tree, registry=None):
    return VerdictCache(tmp_path / "cache", RunConfig(world_sizes=(2,)), registry or load_modules(()), root=tree)


def _touch(path: Path) -> None:
    path.write_text(path.read_text() + "\n# edited\n")


def test_an_operator_unit_reruns_after_its_family_file_changes_and_only_then(tmp_path, tree):
    relu = Unit("op", "relu", world_sizes=(2,), seeds=(0,))
    _cache(tmp_path, tree).put(relu, [_row()], Used())
    got = _cache(tmp_path, tree).get(relu)
    assert got is not None and all(r.cached for r in got) and got[0].seconds == 1.5
    _touch(tree / "opzoo" / "linalg" / "entries.py")  # another family
    _touch(tree / "opzoo" / "nn" / "rules.py")  # a rule file: model units' business
    assert _cache(tmp_path, tree).get(relu) is not None
    _touch(tree / "opzoo" / "activation" / "entries.py")
    assert _cache(tmp_path, tree).get(relu) is None


def test_any_core_file_and_the_run_settings_are_in_the_key(tmp_path, tree):
    relu = Unit("op", "relu", world_sizes=(2,), seeds=(0,))
    _cache(tmp_path, tree).put(relu, [_row()], Used())
    other = VerdictCache(tmp_path / "cache", RunConfig(world_sizes=(2,), dtype="float64"), load_modules(()), root=tree)
    assert other.get(relu) is None
    assert _cache(tmp_path, tree).get(Unit("op", "relu", world_sizes=(2,), seeds=(1,))) is None
    _touch(tree / "nnscaler" / "runtime" / "collectives.py")
    assert _cache(tmp_path, tree).get(relu) is None


def test_every_field_of_the_recipe_is_in_the_key(tmp_path):
    """A recipe option left out of the key would reuse verdicts of another recipe: each field, off its
    default, gives another key (a new field is covered without touching verify/sweep/cache.py)."""
    other = {"int": 2, "float": 0.5, "str": "other", "tuple[str, ...]": ("x",)}
    unit = Unit("model", "nanogpt", "dp", (2,), (0,))
    registry = load_modules(())
    key = VerdictCache(tmp_path, RunConfig(world_sizes=(2,)), registry).key(unit)
    for f in fields(Recipe):
        changed = replace(Recipe(), **{f.name: other[f.type.split("|")[0].strip()]})
        cfg = RunConfig(world_sizes=(2,), recipe=changed)
        assert VerdictCache(tmp_path, cfg, registry).key(unit) != key, f"recipe field {f.name} is not in the key"


# RunConfig fields that change no program, or that the unit itself carries: every other field keys verdicts
NOT_IN_KEY = {"world_sizes": "the unit's own", "seeds": "the unit's own", "timeout_s": "a limit, not the program",
              "recipe": "every field keyed one by one (test above)", "modules": "keyed by content (test above)"}


def test_every_field_of_the_run_config_that_changes_a_program_is_in_the_key(tmp_path):
    """A setting left out of the key reuses verdicts made under another setting (a cluster plan's lowered
    layout, a dtype, a partition): each field of RunConfig off its default gives another key, unless
    :data:`NOT_IN_KEY` says why it need not (a new field is covered without touching this test)."""
    other = {"layout": (("tp_size", 4),), "dtype": "float64", "partition": "b=2", "base_override": 3,
             "node": ("nanogpt", "relu")}
    unit = Unit("model", "nanogpt", "dp", (2,), (0,))
    registry = load_modules(())
    key = VerdictCache(tmp_path, RunConfig(world_sizes=(2,)), registry).key(unit)
    for f in fields(RunConfig):
        if f.name in NOT_IN_KEY:
            continue
        assert f.name in other, f"RunConfig.{f.name}: say whether it changes a program (key it) or why not (NOT_IN_KEY)"
        cfg = replace(RunConfig(world_sizes=(2,)), **{f.name: other[f.name]})
        assert VerdictCache(tmp_path, cfg, registry).key(unit) != key, f"RunConfig.{f.name} is not in the key"


def test_a_saved_plan_unit_reruns_when_its_plan_file_changes(tmp_path, tree):
    plan = tree / "verify" / "plans" / "p.json"
    plan.parent.mkdir(exist_ok=True)
    plan.write_text('{"parallel": {"dp": 8}}\n')
    unit = Unit("plan", "verify/plans/p.json", world_sizes=(2,), seeds=(0,))
    row = Row("plan:p.json", "model", "", 2, "dp2", "float32", 0, "match", seconds=2.0)
    _cache(tmp_path, tree).put(unit, [row], _model_used())
    assert _cache(tmp_path, tree).get(unit) is not None
    plan.write_text('{"parallel": {"dp": 16}}\n')  # same reduced world, another plan
    assert _cache(tmp_path, tree).get(unit) is None


def _model_used():
    used = Used()
    used.ops, used.fixed = {"aten.linear.default", "aten.add.Tensor"}, set()
    return used


def test_a_model_unit_depends_on_the_rules_for_its_operators(tmp_path, tree):
    unit = Unit("model", "nanogpt", "tp", (2,), (0,))
    _cache(tmp_path, tree).put(unit, [_row("model:nanogpt", family="model")], _model_used())
    entry = json.loads(next((tmp_path / "cache").rglob("*.json")).read_text())
    assert "opzoo/linalg/rules.py" in entry["deps"] and "opzoo/elementwise/rules.py" in entry["deps"]
    assert "opzoo/conv/rules.py" not in entry["deps"] and "opzoo/linalg/entries.py" not in entry["deps"]
    _touch(tree / "opzoo" / "activation" / "entries.py")  # an operator family's file: no rule of it ran
    _touch(tree / "opzoo" / "conv" / "rules.py")
    assert _cache(tmp_path, tree).get(unit) is not None
    _touch(tree / "opzoo" / "linalg" / "rules.py")
    assert _cache(tmp_path, tree).get(unit) is None


def test_a_new_claim_on_an_operator_of_the_graph_makes_the_verdict_stale(tmp_path, tree):
    unit = Unit("model", "nanogpt", "tp", (2,), (0,))
    _cache(tmp_path, tree).put(unit, [_row("model:nanogpt", family="model")], _model_used())
    from nnscaler.ops.registry import OpRegistry
    registry = OpRegistry()
    for spec in load_modules(()):
        registry.add(spec)
    reg = load_modules(())
    for overload in reg.rule_overloads():
        for rule in reg.rules(overload):
            registry.add_rule(overload, rule)
    assert _cache(tmp_path, tree, registry).get(unit) is not None

    def conv_rule_for_linear(call):  # as if opzoo/conv/rules.py now claimed aten.linear
        return None
    conv_rule_for_linear.__module__ = "opzoo.conv.rules"
    registry.add_rule("aten.linear.default", conv_rule_for_linear)
    assert _cache(tmp_path, tree, registry).get(unit) is None


def test_failures_are_never_kept_and_a_unit_that_says_nothing_depends_on_every_leaf(tmp_path, tree):
    relu = Unit("op", "relu", world_sizes=(2,), seeds=(0,))
    _cache(tmp_path, tree).put(relu, [_row(), _row(status="MISMATCH")], Used())
    assert _cache(tmp_path, tree).get(relu) is None
    unit = Unit("torchpar", "fsdp", world_sizes=(2,), seeds=(0,))
    used = Used()
    used.every = True
    _cache(tmp_path, tree).put(unit, [_row("torchpar:fsdp", family="model")], used)
    _touch(tree / "opzoo" / "reduction" / "entries.py")
    assert _cache(tmp_path, tree).get(unit) is None


OPS = ["all", "--op", "relu", "linear", "--model", "--torchpar", "--world-size", "2"]


def test_a_rerun_takes_its_verdicts_from_the_cache_and_every_report_says_so(tmp_path, capsys):
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert main(OPS + ["--reports", str(tmp_path / "a")] + cache) == 0
    first = [json.loads(x) for x in (tmp_path / "a" / "cases.jsonl").read_text().splitlines()]
    assert first and not any(r["cached"] for r in first)
    capsys.readouterr()
    assert main(OPS + ["--reports", str(tmp_path / "b")] + cache) == 0
    assert "from the cache" in capsys.readouterr().out
    second = [json.loads(x) for x in (tmp_path / "b" / "cases.jsonl").read_text().splitlines()]
    assert [r["cached"] for r in second] == [True] * len(first)
    assert [{**r, "cached": None} for r in second] == [{**r, "cached": None} for r in first]
    assert "reused from the verdict cache" in (tmp_path / "b" / "report.md").read_text()
    assert "reused from the verdict cache" in (tmp_path / "b" / "report.html").read_text()
    assert (tmp_path / "b" / "junit.xml").read_text().count('name="cached" value="true"') == len(first)
    assert main(OPS + ["--reports", str(tmp_path / "c"), "--no-cache"] + cache) == 0
    assert not any(json.loads(x)["cached"] for x in (tmp_path / "c" / "cases.jsonl").read_text().splitlines())


def test_shards_merge_into_the_whole_run_and_a_missing_one_is_refused(tmp_path, capsys):
    ops = ["all", "--op", "relu", "linear", "softmax", "--model", "--torchpar", "--world-size", "2", "--no-cache"]
    for i in (1, 2):
        assert main(ops + ["--shard", f"{i}/2", "--reports", str(tmp_path / f"s{i}")]) == 0
    units = [json.loads((tmp_path / f"s{i}" / "report.json").read_text())["sweep"]["units"] for i in (1, 2)]
    assert sorted(units[0] + units[1]) == ["linear", "relu", "softmax"] and all(units)
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "s1"), str(tmp_path / "s2"), "--reports", str(tmp_path / "m")]) == 0
    merged = json.loads((tmp_path / "m" / "report.json").read_text())
    whole = [json.loads(x) for i in (1, 2) for x in (tmp_path / f"s{i}" / "cases.jsonl").read_text().splitlines()]
    assert merged["summary"]["cases"] == len(whole) == len((tmp_path / "m" / "cases.jsonl").read_text().splitlines())
    assert merged["sweep"]["merged"] == 2 and "merged from 2 shards" in (tmp_path / "m" / "report.md").read_text()
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "s1"), "--reports", str(tmp_path / "m2")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "verify: error: shard 2/2 is missing (1 of 2 missing)"
    assert main(["merge", str(tmp_path / "s1"), str(tmp_path / "s1"), "--reports", str(tmp_path / "m3")]) == 2
    assert "given twice" in capsys.readouterr().err


def test_resume_of_a_finished_sweep_starts_no_ranks_and_keeps_every_row(tmp_path, capsys):
    args = OPS + ["--reports", str(tmp_path / "a"), "--no-cache"]
    assert main(args) == 0
    before = (tmp_path / "a" / "cases.jsonl").read_text()
    capsys.readouterr()
    assert main(args + ["--resume"]) == 0
    out = capsys.readouterr().out
    assert "0 units, 2 finished before" in out and "gang started 0x" in out
    assert (tmp_path / "a" / "cases.jsonl").read_text() == before
