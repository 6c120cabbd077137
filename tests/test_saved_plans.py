"""The plans ``bench/autodist.py`` prints, saved under ``verify/plans``, verified as ``verify all`` runs them:
a ``plan`` unit reduced as ``python -m verify plan`` reduces it, trained on real ranks against one device
(the default sample's plan here; every saved plan in the slow test), and a plan file that cannot be read
is a failed row of the sweep, not its end."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from verify.cache import Used
from verify.cases.config import RunConfig
from verify.drive import run_unit
from verify.runner.gang import Gang
from verify.selection import DEFAULT_PLANS, PLANS, Unit, plan_units, saved_plans

pytest.importorskip("transformers")


def _rows(gang, unit, tmp_path):
    used = Used()
    rows = list(run_unit(gang, unit, RunConfig(world_sizes=unit.world_sizes), {}, str(tmp_path), frozenset(), used))
    return rows, used


def test_the_default_samples_plan_trains_like_one_device(tmp_path):
    unit = plan_units([PLANS / f"{DEFAULT_PLANS[0]}.json"], (2, 4), (0,))[0]
    with Gang(2, (), (2,)) as gang:
        rows, used = _rows(gang, unit, tmp_path)
        # a plan file that does not hold a plan: one failed row naming the file, the gang still serves
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**json.loads((PLANS / f"{DEFAULT_PLANS[0]}.json").read_text()), "world_size": 3}))
        failed = list(run_unit(gang, Unit("plan", str(bad), world_sizes=(2,), seeds=(0,)),
                               RunConfig(world_sizes=(2,)), {}, str(tmp_path), frozenset(), Used()))
    assert len(rows) == 1 and rows[0].ok, rows
    assert rows[0].op == f"plan:{DEFAULT_PLANS[0]}.json" and "dp2" in rows[0].partition and "zero3" in rows[0].partition
    assert "aten.linear.default" in used.ops  # what the verdict cache keys the unit's leaves on
    assert len(failed) == 1 and not failed[0].ok and "world_size 3" in failed[0].detail
    assert failed[0].rerun == f"python -m verify plan {bad}"


@pytest.mark.slow
def test_every_saved_plan_trains_like_one_device(tmp_path):
    units = plan_units(saved_plans(), (2, 4, 8), (0,))  # verify all runs those at W 2 and 4; W=8 here too
    assert len(units) == len(saved_plans())
    with Gang(8, (), (2, 4, 8)) as gang:
        for unit in units:
            (tmp_path / Path(unit.name).stem).mkdir()
            rows, _ = _rows(gang, unit, tmp_path / Path(unit.name).stem)
            assert rows and all(r.ok for r in rows), (unit.name, rows)
