"""Data-parallel replicas of a plan (``runtime_ngpus > plan_ngpus``): gradients are averaged during
backward with no call from the training loop, and training equals one device on the whole batch."""
from __future__ import annotations

import tempfile

import pytest

from verify.cases import MATCH, judge


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
