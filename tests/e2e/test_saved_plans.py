"""The plans ``bench/calibration/autodist.py`` prints, saved under ``verify/plans``, verified as ``verify all`` runs them:
a ``plan`` unit reduced as ``python -m verify plan`` reduces it, trained on real ranks against one device
(the default sample's plan and one tp x pp x dp plan on 8 ranks here; every saved plan in the slow test),
and a plan file that cannot be read is a failed row of the sweep, not its end."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from verify.sweep.cache import Used
from verify.config import RunConfig
from verify.sweep.drive import run_unit
from verify.sweep.drive import LazyGang
from verify.runner.gang import Gang
from verify.runner.limits import max_ranks
from verify.sweep.selection import DEFAULT_PLANS, PLANS, Unit, plan_units, saved_plans, wide_plan_units

pytest.importorskip("transformers")


def _rows(gang, unit, tmp_path, cfg=None):
    used = Used()
    cfg = cfg or RunConfig(world_sizes=unit.world_sizes)
    return list(run_unit(gang, unit, cfg, {}, str(tmp_path), frozenset(), used)), used


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


def _three_axis_plan() -> tuple[Path, dict]:
    """A saved plan with tp, pp and dp all above 1 (no cp), chosen by what it holds, not by its file name (the
    plans move when the search does): the fewest blocks, interleaved stages first."""
    plans = [(p, json.loads(p.read_text())) for p in saved_plans()]
    three = [(p, d) for p, d in plans if all(d["parallel"][a] > 1 for a in ("tp", "pp", "dp"))
             and d["parallel"].get("cp", 1) == 1]
    if not three:
        pytest.fail("no saved plan in verify/plans has tp, pp and dp all above 1")
    path, plan = min(three, key=lambda x: (x[1]["blocks"], x[1]["parallel"]["virtual_stages"] == 1, x[0].name))
    return path, plan["parallel"]


@pytest.mark.skipif(max_ranks() < 8, reason="this machine runs fewer than 8 ranks")
def test_a_tp_pp_dp_plan_runs_on_a_gang_of_eight_of_its_own(tmp_path):
    """``verify all --full``'s sweep gang has 2 or 4 ranks; a plan with tp, pp and dp all above 1 keeps its
    three axes only at 8, so its unit starts a gang of its own and never the sweep's."""
    path, par = _three_axis_plan()
    unit, = wide_plan_units([path], (2, 4), (0,))
    assert unit.world_sizes == (8,)
    sweep = LazyGang(lambda: Gang(4, (), (2, 4)))
    with sweep:
        rows, used = _rows(sweep, unit, tmp_path, RunConfig(world_sizes=(2, 4)))
    assert sweep.starts == 0
    assert len(rows) == 1 and rows[0].ok, rows
    three = f"tp2{'+sp' if par['sequence_parallel'] else ''} pp2{' v2' if par['virtual_stages'] > 1 else ''} dp2"
    assert rows[0].world_size == 8 and three in rows[0].partition, (three, rows[0].partition)
    assert "aten.linear.default" in used.ops


@pytest.mark.slow
def test_every_saved_plan_trains_like_one_device(tmp_path):
    units = plan_units(saved_plans(), (2, 4, 8), (0,))  # verify all runs those at W 2 and 4; W=8 here too
    assert len(units) == len(saved_plans())
    with Gang(8, (), (2, 4, 8)) as gang:
        for unit in units:
            (tmp_path / Path(unit.name).stem).mkdir()
            rows, _ = _rows(gang, unit, tmp_path / Path(unit.name).stem)
            assert rows and all(r.ok for r in rows), (unit.name, rows)
