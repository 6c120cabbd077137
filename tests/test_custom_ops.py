"""Graph corner cases the compiler must not get silently wrong: lifted constants and in-place writes
(``t[..., 0] = scalar``), custom ``autograd.Function``s, and ``register_op`` on plain functions."""
from __future__ import annotations

import tempfile

import pytest

from verify.cases import MATCH, RunConfig, run_model
from verify.models.builders import MODELS


def _rows(gang, name, policies, world_sizes=(2,), steps=2):
    with tempfile.TemporaryDirectory() as tmp:
        return [(r.world_size, r.partition, r.status, r.detail)
                for r in run_model(gang, name, policies, RunConfig(world_sizes=world_sizes), tmp, steps=steps)]


def test_a_scalar_written_into_a_slice_compiles_and_matches_under_every_policy(gang):
    rows = _rows(gang, "lifted_constant", ("dp", "tp", "hybrid", "random"), (2, 4))
    assert [r for r in rows if r[2] != MATCH] == [] and len(rows) == 8


def test_t5_with_labels_compiles_and_matches_under_every_policy(gang):
    pytest.importorskip("transformers")
    rows = _rows(gang, "t5_labels", ("dp", "tp", "hybrid", "random"), steps=1)
    assert [r for r in rows if r[2] != MATCH] == [] and len(rows) == 4
