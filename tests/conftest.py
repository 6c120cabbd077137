"""Shared fixtures: one persistent rank gang per test process (xdist worker), reused by every test.

The gang is the one our pytest plugin (``verify.pytest_plugin``) gives every user's suite; the
fixture files its ranks import are named once, by ``verify_modules`` in pyproject.toml."""
from __future__ import annotations

from pathlib import Path

import pytest

from verify.runner.worker import load_modules
from verify.user_files import forget

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).parent.parent


def _ini_modules() -> tuple[str, ...]:
    """The fixture files of ``verify_modules`` in pyproject.toml (for tests that start gangs of their own)."""
    import tomllib
    with open(ROOT / "pyproject.toml", "rb") as fh:
        return tuple(str(ROOT / m) for m in tomllib.load(fh)["tool"]["pytest"]["ini_options"]["verify_modules"])


MODULES = _ini_modules()


def split_ids(label: str) -> set[str]:
    """The identifiers an operator row's partition label (``Partition.label``: ``m=2,k=2/3``) splits."""
    return set() if label == "replicate" else {part.split("=")[0] for part in label.split(",")}


def assert_caught_where_split(rows, *idents: str) -> None:
    """A known-wrong operator's rows: MISMATCH exactly where its partition splits one of ``idents``,
    and some do."""
    from verify.judge.verdict import MATCH, MISMATCH
    for row in rows:
        wrong = bool(set(idents) & split_ids(row.partition))
        assert row.status == (MISMATCH if wrong else MATCH), (row.partition, row.status)
    assert any(row.status == MISMATCH for row in rows)


def zoo_graph(arch: str):
    """The traced graph of ``zoo:<arch>`` (``verify.models.zoo``, seed 0), the library's warnings quiet."""
    import warnings
    from nnscaler.compile.plan import trace_model
    from verify.models.zoo import build
    case = build(arch, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace_model(case.model, case.batch(0), None, registry=None, strict=False)


def first_mismatch(cases, run):
    """``(case, row)`` of the first of ``cases`` whose row (``run(case)``) mismatches. Every row must
    fail: a wrong split may make a later view fail outright (an error row, also a failure), and then
    the next case is tried; the test fails when every one errored."""
    from verify.judge.verdict import MATCH, MISMATCH
    for case in cases:
        row = run(case)
        assert row.status != MATCH, row
        if row.status == MISMATCH:
            return case, row
    pytest.fail("every wrong split errored")


@pytest.fixture(scope="session")
def registry(pytestconfig):
    """The default registry with opzoo and the test fixtures' operators (the ranks' own)."""
    return load_modules([str(p) for p in pytestconfig.getini("verify_modules")])


@pytest.fixture(scope="session")
def gang(registry, verify_gang):
    """Four ranks serving world sizes 2 and 4 for the whole session (the plugin's gang)."""
    return verify_gang.gang


@pytest.fixture(autouse=True)
def _leaves_no_process_group():
    """A test that leaves torchrun's variables in this worker's environment, or a default process group
    up, errors: a later test's ``parallelize`` would silently make a group from them (torch's env://
    store listens on every interface)."""
    import os
    import torch.distributed as dist
    before = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    yield
    left = [k for k, v in before.items() if os.environ.get(k) != v]
    up = dist.is_available() and dist.is_initialized()
    if up:
        dist.destroy_process_group()
    assert not left and not up, f"the test left {left or 'the default process group up'}: use the one_rank fixture"


@pytest.fixture()
def one_rank():
    """A process group of this process alone (gloo on an in-memory store: no socket is opened and no
    torchrun variable is set, so nothing leaks into the tests that share this worker)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def wrong_norm_rules():
    """``tests/fixtures/wrong_norm_rules.py`` loaded into this process for one test module (it plans
    with the same wrong rules as the ranks), then taken out again, module and rules, so the next
    module that asks loads it afresh and the rest of the session plans with the right rules."""
    import sys
    from nnscaler import DEFAULT_REGISTRY
    path = str(FIXTURES / "wrong_norm_rules.py")
    load_modules([path])
    try:
        yield path
    finally:
        tag = "verify_user_" + str(abs(hash(str(Path(path).resolve()))))
        DEFAULT_REGISTRY.remove_rules(lambda r: r.__module__ != tag)
        sys.modules.pop(tag, None)
        forget(path)  # imported once (verify/user_files.py): the next module that asks imports it afresh
