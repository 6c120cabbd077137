"""The harness catches known-wrong annotations, passes correct ones, and turns faults into rows."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from verify.judge.verdict import CRASH, ERROR, MATCH, MISMATCH, TIMEOUT

from verify.config import RunConfig

from verify.rows.run import run_op
from conftest import split_ids

WRONG = {  # op -> the identifier whose split makes it wrong
    "wrong_softmax": "b",
    "wrong_sum_spatial": "b",
    "wrong_mean_value": "b",
    "wrong_flip": "b",
    "wrong_cumsum": "b",
    "wrong_backward_clip": None,  # any split changes the gradient's norm
}
RIGHT = ["right_rowscale", "sensitive_sum_4096", "right_mean_value", "right_reshape"]
PROFILE = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])



@pytest.mark.parametrize("name", sorted(WRONG))
@PROFILE
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from(["float32", "float64"]), base=st.sampled_from([4, 8, 12]))
def test_wrong_annotation_is_caught(gang, registry, name, seed, dtype, base):
    cfg = RunConfig(world_sizes=(2, 4), dtype=dtype, seeds=(seed,), base_override=base)  # base scales the shapes
    rows = list(run_op(gang, registry.get(name), cfg))
    culprit = WRONG[name]
    for row in rows:
        wrong = bool(split_ids(row.partition)) if culprit is None else culprit in split_ids(row.partition)
        assert row.status == (MISMATCH if wrong else MATCH), (row.partition, row.status, row.detail)
        if wrong:
            assert row.rerun.startswith("python -m verify op " + name)


def test_wrong_backward_is_caught_only_in_the_gradient(gang, registry):
    rows = list(run_op(gang, registry.get("wrong_backward_clip"), RunConfig(world_sizes=(2,))))
    bad = [r for r in rows if r.status == MISMATCH]
    assert bad and all(r.detail.startswith("grad of input 0") for r in bad)
    assert all(r.out_err <= r.out_tol for r in bad)


@pytest.mark.parametrize("name", RIGHT)
@PROFILE
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from(["float32", "float64", "bfloat16"]),
       base=st.sampled_from([4, 8, 12]))
def test_correct_annotation_passes(gang, registry, name, seed, dtype, base):
    cfg = RunConfig(world_sizes=(2, 4), dtype=dtype, seeds=(seed,), base_override=base)
    rows = list(run_op(gang, registry.get(name), cfg))
    assert len(rows) > 2
    assert [r for r in rows if r.status != MATCH] == []


def test_a_float64_sum_that_cancels_is_judged_by_its_conditioning(gang, registry):
    """Under float64 the one-device run is the reference itself; its rounding comes from the float32
    run scaled to float64's unit. A correct split sum of 4096 cancelling values passes on every
    seed (7 of these 100 seeds false-alarmed with the bare floor), a spatially split sum still fails."""
    cfg = RunConfig(world_sizes=(2,), dtype="float64", seeds=tuple(range(100)), base_override=4)
    rows = list(run_op(gang, registry.get("sensitive_sum_4096"), cfg))
    assert len(rows) == 200 and all(r.status == MATCH for r in rows), [r.detail for r in rows if not r.ok][:3]
    wrong = list(run_op(gang, registry.get("wrong_sum_spatial"), RunConfig(world_sizes=(2,), dtype="float64", seeds=(0, 1))))
    assert all(r.status == (MISMATCH if "b" in split_ids(r.partition) else MATCH) for r in wrong)
    assert any(r.status == MISMATCH for r in wrong)


def test_a_bf16_split_sum_is_judged_by_its_partials(gang, registry):
    """A bf16 sum split by value rounds each rank's partial: where they cancel, the error is set by
    the partials, not by the result (seed 688 failed by 0.0386 > 0.03 under the floor alone). A
    correct split passes over 40 seeds; a spatially split sum still fails under bf16."""
    cfg = RunConfig(world_sizes=(2,), dtype="bfloat16", seeds=(688, *range(39)), base_override=4)
    rows = list(run_op(gang, registry.get("sensitive_sum_4096"), cfg))
    assert len(rows) == 80 and all(r.status == MATCH for r in rows), [r.detail for r in rows if not r.ok][:3]
    wrong = list(run_op(gang, registry.get("wrong_sum_spatial"), RunConfig(world_sizes=(2,), dtype="bfloat16", seeds=(0, 1))))
    assert all(r.status == (MISMATCH if "b" in split_ids(r.partition) else MATCH) for r in wrong)
    assert any(r.status == MISMATCH for r in wrong)


@pytest.mark.parametrize("name,status,reason", [
    ("faulty_raise", ERROR, "boom on a shard"),
    ("faulty_base_exception", ERROR, "ShardFailure: a BaseException on a shard"),
    ("faulty_exit", CRASH, "exit code 7"),
    ("faulty_segfault", CRASH, "exit code -11) (on a fresh gang too: the case was run twice)"),
    ("faulty_hang", TIMEOUT, "no answer"),
    ("faulty_nan", MISMATCH, "NaN"),
])
def test_faults_are_failing_rows_and_the_sweep_goes_on(gang, registry, name, status, reason):
    # base 4 gives the lengths faulty_ops.FULL assumes; one split partition keeps restarts few
    cfg = RunConfig(world_sizes=(2,), timeout_s=4.0, base_override=4, partition="a=2")
    (row,) = run_op(gang, registry.get(name), cfg)
    assert row.status == status and reason in row.detail, (row.status, row.detail)
    assert "--partition a=2" in row.rerun
    # the gang is usable again right after
    after = list(run_op(gang, registry.get("right_rowscale"), RunConfig(world_sizes=(2, 4))))
    assert after and all(r.ok for r in after)
