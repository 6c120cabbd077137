"""Layout conversions and the 2-D random policy on 8 real ranks (a gang of its own): 3-D meshes
(2, 2, 2), where one dim may be split on all three axes, and the (2, 4) / (4, 2) meshes random2d
draws at W=8. Each conversion runs on the ranks and is compared with the whole tensor, forward and
backward (see ``verify/cases/conversion.py``)."""
from __future__ import annotations

import tempfile

import pytest
from hypothesis import HealthCheck, given, settings

from tests.conftest import MODULES
from tests.compiler.test_conversion import cases, run_on_ranks
from verify.judge.verdict import MATCH
from verify.config import RunConfig
from verify.rows.run import run_model
from verify.runner.gang import Gang, max_ranks

MESHES_8 = [(2, 2, 2), (2, 4), (4, 2)]

pytestmark = pytest.mark.skipif(max_ranks() < 8, reason="this machine runs fewer than 8 ranks")


@pytest.fixture(scope="module")
def gang8(registry):
    with Gang(8, MODULES, (8,)) as g:
        yield g


@pytest.mark.slow  # the 8-rank gang alone takes 40 s to start on 2 loaded cores
@pytest.mark.parametrize("src,dst,mesh,shape", [
    ("D0xD0xD0", "RxRxD1", (2, 2, 2), (8, 4)),     # one dim on three axes, nested, gathered, another split
    ("D0xD1xD2", "D2xD0xD1", (2, 2, 2), (2, 2, 2)),  # every axis moves to another dim
    ("VxD1xD0", "D1xD1xV", (2, 2, 2), (4, 8)),     # a partial sum reduce-scattered into a doubly split dim
])
def test_named_conversions_on_eight_ranks(gang8, src, dst, mesh, shape):
    job = {"kind": "conversion", "mesh": list(mesh), "shape": list(shape), "src": src, "dst": dst,
           "ids": [None] * len(mesh), "grad": True, "seed": 11}
    answers = run_on_ranks(gang8, job)
    assert len(answers) == 8
    for r in answers:
        assert r["problems"] == [], f"{src} -> {dst} via {r['steps']}: {r['problems']}"


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(job=cases(meshes=MESHES_8))
def test_every_conversion_on_eight_ranks_gives_the_right_pieces(gang8, job):
    for r in run_on_ranks(gang8, job):
        assert r["problems"] == [], f"{job} via {r['steps']}: {r['problems']}"


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(job=cases(meshes=MESHES_8, blocks=True))
def test_conversions_in_blocks_on_eight_ranks_give_the_right_pieces(gang8, job):
    for r in run_on_ranks(gang8, job):
        assert r["problems"] == [], f"{job} via {r['steps']}: {r['problems']}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nanogpt", "llama"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random2d_programs_match_at_eight_ranks(gang8, name, seed):
    if name == "llama":
        pytest.importorskip("transformers")
    with tempfile.TemporaryDirectory() as tmp:
        rows = list(run_model(gang8, name, ("random2d",), RunConfig(world_sizes=(8,), seeds=(seed,)), tmp, steps=2))
    assert [(r.status, r.detail) for r in rows] == [(MATCH, "")]
