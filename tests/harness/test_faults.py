"""The harness fails closed under hostile operators (issue #11 items 1-4, 9; #7.4): isolated cases,
random and complex operators judged honestly, no poisoned sweeps, errors reported as errors, no
orphans, a memory cap. Uses its own small gang (these tests restart it on purpose)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from verify.runner import isolation
from verify.judge.verdict import CRASH, ERROR, MATCH, MISMATCH, TIMEOUT, UNVERIFIABLE
from verify.config import RunConfig
from verify.rows.run import run_op
from verify.runner.gang import Gang, WorldSizeError, max_ranks

from conftest import FIXTURES, MODULES

HOSTILE = MODULES + (str(FIXTURES / "hostile_ops.py"),)
W2 = RunConfig(world_sizes=(2,), base_override=4)


@pytest.fixture(scope="module")
def hreg(registry):
    """The registry with the hostile operators too."""
    from verify.runner.worker import load_modules
    return load_modules(HOSTILE)


@pytest.fixture(scope="module")
def hgang(hreg):
    with Gang(2, HOSTILE, (2,)) as g:
        yield g


def rows_of(gang, registry, name, cfg=W2):
    return list(run_op(gang, registry.get(name), cfg))


def clean_rows(gang, registry):
    return [(r.op, r.partition, r.status, r.out_err, r.grad_err)
            for name in ("right_rowscale", "right_reshape") for r in rows_of(gang, registry, name)]


@pytest.fixture
def busy():
    """Two CPU burners: the machine is loaded while the test runs (2 cores here)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for p in procs:
        p.kill()
        p.wait()


# -- 1. global state ------------------------------------------------------------------------------
@pytest.mark.parametrize("name,leak", [("hostile_grad_off", "gradient mode disabled"),
                                       ("hostile_dtype", "default dtype torch.float64"),
                                       ("hostile_chdir", "working directory /")])
def test_a_case_that_leaks_global_state_is_reported_and_the_next_starts_clean(hgang, registry, name, leak):
    before = clean_rows(hgang, registry)
    rows = rows_of(hgang, registry, name)
    assert rows and all(r.status == ERROR and leak in r.detail for r in rows), [(r.status, r.detail) for r in rows]
    after = clean_rows(hgang, registry)
    assert after == before  # gradients still compared, same numbers
    assert all(g is not None for *_, g in after)


def test_a_row_whose_gradient_could_not_be_checked_is_never_a_match(hgang, registry):
    rows = rows_of(hgang, registry, "hostile_no_grad")
    assert rows and all(r.status == MISMATCH and "gradient check could not run" in r.detail for r in rows)


# -- 2. random and complex operators --------------------------------------------------------------
def test_a_random_operator_is_not_verifiable_under_any_split(hgang, registry):
    rows = rows_of(hgang, registry, "hostile_dropout")
    assert rows and all(r.status == UNVERIFIABLE and not r.ok for r in rows)
    assert "random" in rows[0].detail


def test_complex_outputs_are_compared_whole_with_complex_cotangents(hgang, registry):
    for r in rows_of(hgang, registry, "wrong_complex_imag"):
        assert r.status == (MISMATCH if "b" in r.partition else MATCH), (r.partition, r.status, r.detail)
    right = rows_of(hgang, registry, "right_complex")
    assert right and all(r.status == MATCH and r.grad_err is not None for r in right)


# -- 3. pending collectives -----------------------------------------------------------------------
def test_a_one_sided_collective_ends_as_a_harness_timeout_and_poisons_nothing(hgang, registry):
    before = clean_rows(hgang, registry)
    starts = hgang.starts
    cfg = RunConfig(world_sizes=(2,), base_override=4, timeout_s=5.0, partition="a=2")
    (row,) = rows_of(hgang, registry, "one_sided_collective", cfg)
    assert row.status == TIMEOUT and "limit of 5 s" in row.detail, row.detail
    assert clean_rows(hgang, registry) == before  # no "Connection closed by peer" afterwards
    assert hgang.starts == starts + 1
    assert hgang.pg_timeout_s > 100 * cfg.timeout_s  # gloo's own timeout never decides


def test_an_error_in_a_multi_rank_case_restarts_the_gang(hgang, registry):
    starts = hgang.starts
    cfg = RunConfig(world_sizes=(2,), base_override=4, partition="a=2")
    (row,) = rows_of(hgang, registry, "faulty_raise", cfg)
    assert row.status == ERROR
    rows_of(hgang, registry, "right_rowscale")
    assert hgang.starts == starts + 1


# -- #7.4 errors are errors -----------------------------------------------------------------------
def test_an_error_outranks_a_slow_peer_under_load(hgang, registry, busy):
    cfg = RunConfig(world_sizes=(2,), base_override=4, timeout_s=60.0, partition="a=2")
    (row,) = rows_of(hgang, registry, "raise_while_peer_slow", cfg)
    assert row.status == ERROR and "rank 0: ValueError: rank zero's own error" in row.detail, row.detail
    assert "raise ValueError" in row.traceback and row.seconds < 30


def test_a_timeout_reports_the_true_limit_and_the_time_waited(hgang, registry):
    cfg = RunConfig(world_sizes=(2,), base_override=4, timeout_s=3.0, partition="a=2")
    t0 = time.monotonic()
    (row,) = rows_of(hgang, registry, "faulty_hang", cfg)
    elapsed = time.monotonic() - t0
    assert row.status == TIMEOUT and "limit of 3 s" in row.detail
    waited = float(row.detail.split("waited ")[1].split(" s")[0])
    assert 3.0 <= waited <= elapsed


def test_the_limit_scales_with_the_case():
    cfg = RunConfig(timeout_s=30.0)
    assert cfg.limit_s("op") == 30.0
    assert cfg.limit_s("model", 3) > 4 * cfg.limit_s("op")
    assert cfg.limit_s("model", 12) == 4 * cfg.limit_s("model", 3)


# -- the sweep as a whole -------------------------------------------------------------------------
def test_rows_after_a_sweep_of_hostile_operators_equal_a_clean_run(hgang, registry):
    clean = clean_rows(hgang, registry)
    quick = RunConfig(world_sizes=(2,), base_override=4, timeout_s=4.0)
    for name in ("hostile_grad_off", "hostile_dtype", "hostile_chdir", "hostile_dropout", "one_sided_collective",
                 "faulty_exit", "faulty_nan"):
        rows_of(hgang, registry, name, quick)
    assert clean_rows(hgang, registry) == clean


# -- 4. orphans -----------------------------------------------------------------------------------
def test_processes_a_case_spawns_are_killed_after_it(hgang, registry):
    pids = Path(tempfile.gettempdir()) / "verify_hostile_spawn.pids"  # hostile_ops.SPAWN_LOG
    pids.unlink(missing_ok=True)
    rows = rows_of(hgang, registry, "hostile_spawn")
    assert rows and all(r.status == ERROR and "child processes" in r.detail for r in rows)
    spawned = [int(p) for p in pids.read_text().split()]
    assert spawned and not any(isolation._alive(p) for p in spawned)


def test_ranks_and_helpers_die_with_the_harness(sig=signal.SIGKILL):  # SIGTERM ends Python the same way
    root = Path(__file__).resolve().parents[2]
    p = subprocess.Popen([sys.executable, str(FIXTURES / "gang_parent.py")], stdout=subprocess.PIPE, text=True,
                         cwd=root, env=dict(os.environ, PYTHONPATH=str(root)))
    try:
        info = json.loads(p.stdout.readline())
        tree = isolation.descendants(p.pid)
        assert set(info["ranks"]) <= set(tree) and len(tree) >= 3  # ranks, forkserver, resource tracker
    finally:
        os.kill(p.pid, sig)
        p.wait(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(isolation._alive(q) for q in tree):
        time.sleep(0.2)
    assert [q for q in tree if isolation._alive(q)] == []


# -- 9. resources ---------------------------------------------------------------------------------
def test_world_sizes_the_machine_cannot_run_are_refused():
    with pytest.raises(WorldSizeError, match=f"at most {max_ranks()} ranks"):
        Gang(max_ranks() + 1)


def test_a_rank_growing_past_the_memory_cap_is_stopped_and_the_gang_restarted(hreg):
    registry = hreg
    with Gang(2, HOSTILE, (2,)) as g:
        rows_of(g, registry, "right_rowscale")
        g.memory_mb = max(isolation.rss_mb(pid) for pid in g.pids) + 200  # two leaks of 96 MiB fit, not three
        cfg = RunConfig(world_sizes=(2,), base_override=4, partition="a=2")
        rows = [rows_of(g, registry, "leak_memory", cfg)[0] for _ in range(4)]
        assert g.starts > 1 or any(r.status == CRASH and "over the limit" in r.detail for r in rows)
        assert rows_of(g, registry, "right_rowscale")[0].ok
        assert g.starts > 1
        assert max(isolation.rss_mb(pid) for pid in g.pids) < g.memory_mb  # a fresh gang
