"""Data-parallel replicas of a plan (``runtime_ngpus > plan_ngpus``): gradients are averaged during
backward with no call from the training loop, and training equals one device on the whole batch;
``verify model --replicas R`` and ``verify all`` run such cases, and a replica sync that is missing
fails them."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

from verify.judge.verdict import MATCH, MISMATCH, judge

from verify.config import RunConfig
from verify.cli import main
from verify.rows.replicas import replica_items, run_replicas
from verify.runner.gang import Gang

UNSYNCED = str(Path(__file__).parents[1] / "fixtures" / "replicas_unsynced.py")
sys.path.insert(0, str(Path(__file__).parents[1] / "fixtures"))
import replica_grad_ranks  # noqa: E402


def _replicas(gang, name, policy, plan_ngpus=2, world_size=4, steps=2):
    with tempfile.TemporaryDirectory() as tmp:
        job = {"kind": "model", "model": name, "policy": policy, "world_size": world_size, "plan_ngpus": plan_ngpus,
               "steps": steps, "seed": 0, "gen_dir": tmp}
        return judge(gang.run(job, world_size, 240))


@pytest.mark.parametrize("name", ["nanogpt", "transformer_encoder"])
def test_a_tp_plan_times_two_replicas_trains_like_one_device(gang, name):
    status, detail, checks, _ = _replicas(gang, name, "tp")
    assert status == MATCH, detail
    assert any(c["name"].startswith("grad") for c in checks) and any(c["name"].startswith("param") for c in checks)


def test_a_dp_plan_times_two_replicas_trains_like_one_device(gang):
    status, detail, _, _ = _replicas(gang, "nanogpt", "dp")
    assert status == MATCH, detail


def _replica_rows(gang, name="weightnorm_mlp", steps=2):
    with tempfile.TemporaryDirectory() as tmp:
        return list(run_replicas(gang, name, ("tp",), RunConfig(world_sizes=(4,)), tmp, 2, steps=steps))


def test_replicas_rows_name_the_plan_and_padded_targets_match_the_data_parallel_objective(gang):
    (row,) = _replica_rows(gang, "padded_gpt")  # shares with unequal padding: the mean of the shares' losses
    assert (row.status, row.detail) == (MATCH, "") and row.partition == "tp x2 replicas" and row.world_size == 4


def test_replicas_that_are_not_averaged_fail_the_case():
    with Gang(4, (UNSYNCED,), (4,)) as bad:
        (row,) = _replica_rows(bad, steps=1)
    assert row.status == MISMATCH and row.detail.startswith("grad"), row.detail
    assert row.rerun.endswith("--replicas 2") and "--policy tp --world-size 4" in row.rerun


def test_verify_all_runs_a_tp_plan_times_two_replicas_for_every_model_where_the_world_allows():
    items = dict(replica_items(["nanogpt", "t5"], (2, 4)))
    assert items["model:nanogpt tp x2 replicas"] == ("nanogpt", "tp", 2, (4,)) and "model:t5 tp x2 replicas" in items
    assert items["model:nanogpt pp x2 replicas"] == ("nanogpt", "pp", 2, (4,))
    assert "model:t5 pp x2 replicas" not in items
    assert replica_items(["nanogpt"], (2,)) == [] and replica_items(["nanogpt"], (2, 4, 8))[0][1][3] == (4, 8)


@pytest.mark.parametrize("args,needle", [(["--world-size", "4", "--replicas", "3"], "world size 4 is not a multiple"),
                                         (["--replicas", "0"], "--replicas must be a finite number above 0")])
def test_replicas_that_do_not_divide_the_world_size_exit_2_with_one_line(args, needle, capsys):
    assert main(["model", "nanogpt", "--policy", "tp", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines


@pytest.mark.parametrize("mode", ["none", "zero", "accumulate"])
def test_replica_gradients_equal_ddps_whether_freed_zeroed_in_place_or_accumulated(mode):
    """Gradients are views into the sync buckets: freed by ``zero_grad()``, zeroed in place, or
    accumulated over two backward passes (each synced, as DDP does without ``no_sync``), every
    gradient equals DistributedDataParallel's, step after step."""
    worst = replica_grad_ranks.run(mode)
    assert max(worst) < 1e-6, worst
