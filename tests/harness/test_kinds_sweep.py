"""What the sweep asks a unit's registered kind (``verify/kinds/``): its label, its rows' rerun lines and
its verdict-cache key, pinned as they were when the sweep answered them itself (selection, run config,
cache), and the cache key weakened by no recipe field."""
from __future__ import annotations

from dataclasses import asdict, fields, replace
from pathlib import Path

import pytest

from nnscaler.recipe import Recipe

from verify.config import RunConfig
from verify.kinds import KINDS, kind_class
from verify.kinds.model import Model
from verify.kinds.op import Op
from verify.kinds.plan import Plan, file_digest
from verify.kinds.torchpar import Torchpar
from verify.runner.worker import load_modules
from verify.sweep.cache import ROOT, VerdictCache
from verify.sweep.selection import Unit

PLAN = "verify/plans/llama3-70b-64.json"
UNITS = {  # unit -> its label before the kinds answered it (verify/sweep/selection.py's UNIT_LABELS)
    Unit("op", "nn.linear", world_sizes=(2, 4), seeds=(0,)): "nn.linear",
    Unit("model", "nanogpt", "tp", (2,), (1,), 4, 1, False, False): "model:nanogpt tp mb4 W=2 seed 1 no-resume",
    Unit("model", "llama", "tp", (4,), (0,), 1, 2, False, True):
        "model:llama tp x2 replicas bf16-mixed zero3 clip1 recompute=full W=4 seed 0 no-resume",
    Unit("model", "nanogpt", "pp2_dp", (4,), (0,), 4, 1, True, True, 2):
        "model:nanogpt pp2_dp mb4 bf16-mixed zero3 clip1 recompute=full W=4 seed 0",
    Unit("torchpar", "fsdp_tp", world_sizes=(4,), seeds=(0,)): "torchpar:fsdp_tp W=4",
    Unit("plan", PLAN, world_sizes=(2,), seeds=(0,)): "plan:llama3-70b-64 W=2 seed 0",
}
CFG = RunConfig(world_sizes=(2, 4), modules=("/x/m.py",), recipe=Recipe(precision="bf16-mixed", zero=1, clip_grad_norm=0.5))


def test_every_sweep_kind_is_registered_and_labels_its_units_as_before():
    assert {"op", "model", "torchpar", "plan"} <= set(KINDS)
    assert {u: u.label for u in UNITS} == UNITS


def test_rerun_lines_of_an_op_a_model_a_replicas_and_a_torchpar_row_are_as_before():
    assert Op.rerun_command(CFG, "nn.linear", 2, "split a", 0) == (
        "python -m verify op nn.linear --world-size 2 --partition 'split a' --seed 0 --dtype float32 --base 4 "
        "--module /x/m.py")
    assert Op.rerun_command(RunConfig(node=("nanogpt", "linear_1")), "x", 2, "p", 0) == (
        "python -m verify op --model nanogpt --node linear_1 --world-size 2 --partition p --seed 0 --dtype float32")
    assert Model.rerun_command(CFG, "nanogpt", "tp", 2, 0, 3) == (
        "python -m verify model nanogpt --policy tp --world-size 2 --seed 0 --steps 3 --dtype float32 "
        "--precision bf16-mixed --zero 1 --clip-grad-norm 0.5 --module /x/m.py")
    assert Model.rerun_command(CFG, "nanogpt", "tp", 4, 1, 2, 4096, replicas=2) == (
        "python -m verify model nanogpt --policy tp --world-size 4 --seed 1 --steps 2 --dtype float32 "
        "--precision bf16-mixed --zero 1 --clip-grad-norm 0.5 --bucket-bytes 4096 --module /x/m.py --replicas 2")
    assert Torchpar.rerun_command(CFG, "m.py:build", "/a/p.py:fn", "tp=2", 2, 0, 3) == (
        "python -m verify model m.py:build --parallelize /a/p.py:fn --mesh tp=2 --world-size 2 --seed 0 --steps 3 "
        "--dtype float32")  # torch's own modules run: no --module
    assert Plan.rerun_command(RunConfig(modules=("/x/m.py",)), "p.json", True, "bf16-mixed") == (
        "python -m verify plan p.json --as-planned --precision bf16-mixed --module /x/m.py")


def test_a_kind_gives_its_cache_key_entries():
    for unit in UNITS:
        entries = kind_class(unit.kind).cache_key(unit, ROOT)
        want = {"unit": asdict(unit), **({"plan": file_digest(ROOT / PLAN)} if unit.kind == "plan" else {})}
        assert entries == want, unit.label
    assert file_digest(ROOT / "no" / "such.json") == "missing"


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Each unit's key under the default recipe (one cache: it hashes the whole checkout)."""
    registry = load_modules(())
    cache = VerdictCache(tmp_path_factory.mktemp("cache"), RunConfig(world_sizes=(2,)), registry)
    return registry, {u: cache.key(u) for u in UNITS}


@pytest.mark.parametrize("name", [f.name for f in fields(Recipe)])
def test_the_cache_key_changes_when_any_recipe_field_changes(tmp_path, keys, name):
    """A key ignoring one recipe field would hand a verdict of one recipe to another."""
    other = {"int": 2, "float": 0.5, "str": "other", "tuple[str, ...]": ("x",)}
    registry, before = keys
    f = next(f for f in fields(Recipe) if f.name == name)
    cache = VerdictCache(tmp_path, RunConfig(world_sizes=(2,), recipe=replace(Recipe(), **{name: other[f.type.split("|")[0].strip()]})),
                         registry)
    assert [u.label for u in UNITS if cache.key(u) == before[u]] == []


@pytest.mark.slow
def test_a_kind_of_its_own_gives_its_units_and_drives_its_rows_through_the_sweep(tmp_path):
    """``tests/fixtures/own_kind.py`` registers a kind on the ranks and here: ``verify all``'s matrix and
    default sample hold its unit, the sweep labels, runs, judges and caches it, and no sweep file names it."""
    from verify.judge.verdict import MATCH
    from verify.runner.gang import Gang
    from verify.sweep.drive import run_units
    from verify.sweep.selection import default_units, full_units
    from verify.user_files import forget
    path = str(Path(__file__).parents[1] / "fixtures" / "own_kind.py")
    load_modules([path])
    try:
        full = full_units([], [], [], (2,), (0,), (0,), (), (), False)
        unit = Unit("allreduce_for_test", "sum", world_sizes=(2,), seeds=(0,))
        assert unit in full and unit in default_units(full, [], [], (2,), (0,))
        assert unit not in full_units([], [], [], (2,), (0,), (0,), (), (), False, kinds=False)
        assert unit.label == "allreduce_for_test:sum W=2 seed 0"
        cfg = RunConfig(world_sizes=(2,), modules=(path,))
        got = []

        def record(u, rows, cached):
            got.extend(rows)
            return got

        with Gang(2, (path,), (2,)) as g:
            run_units(g, [unit], cfg, {}, str(tmp_path), set(), {}, VerdictCache(tmp_path, cfg, load_modules(())),
                      record)
        assert [(r.op, r.status) for r in got] == [("allreduce_for_test:sum", MATCH)], got
        assert [r.cached for r in VerdictCache(tmp_path, cfg, load_modules(())).get(unit)] == [True]
    finally:
        KINDS.pop("allreduce_for_test", None)
        forget(path)
