"""nnScaler's catalogue as a regression suite: its annotations (re-expressed in
``fixtures/nnscaler_catalogue.py`` with the matching torch functions) all verify at world sizes 2
and 4, and its known-wrong ones are flagged, each with a one-line why."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from verify.config import BadInput, RunConfig

from verify.judge.verdict import MATCH

from verify.rows.run import run_op
from verify.runner.worker import load_modules

CATALOGUE = str(Path(__file__).parents[1] / "fixtures" / "nnscaler_catalogue.py")
REGISTRY = load_modules((CATALOGUE,))  # the session gang imports the same file under the same name
MODULE = next(m for m in sys.modules.values() if getattr(m, "__file__", None) == str(Path(CATALOGUE).resolve()))
RIGHT = sorted(s.name for s in REGISTRY if s.family == MODULE.RIGHT)
WRONG = MODULE.WRONG
CFG = RunConfig(world_sizes=(2, 4), seeds=(0,))


def test_catalogue_is_large_and_every_wrong_entry_says_why():
    assert len(RIGHT) >= 150, len(RIGHT)
    assert len(WRONG) >= 8
    assert {s.name for s in REGISTRY if s.family == MODULE.WRONG_FAMILY} == set(WRONG)
    for name, why in WRONG.items():
        assert why.strip() and "\n" not in why and len(why) < 140, name


@pytest.mark.parametrize("name", RIGHT)
def test_nnscaler_annotation_verifies(gang, name):
    rows = list(run_op(gang, REGISTRY.get(name), CFG))
    assert rows and all(r.ok for r in rows), [(r.world_size, r.partition, r.status, r.detail) for r in rows if not r.ok]


@pytest.mark.parametrize("name", sorted(WRONG))
def test_nnscaler_known_wrong_annotation_is_flagged(gang, name):
    try:
        rows = list(run_op(gang, REGISTRY.get(name), CFG))
    except BadInput:  # an annotation that does not even fit its function's result: refused before any rank runs
        return
    assert any(r.status != MATCH for r in rows), f"{name} passed, but {WRONG[name]}"
