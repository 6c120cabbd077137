"""Shared fixtures: one persistent rank gang per test process (xdist worker), reused by every test."""
from __future__ import annotations

from pathlib import Path

import pytest

from verify.gang import Gang
from verify.worker import load_modules

FIXTURES = Path(__file__).parent / "fixtures"
MODULES = (str(FIXTURES / "wrong_ops.py"), str(FIXTURES / "faulty_ops.py"), str(FIXTURES / "wrong_model.py"),
           str(FIXTURES / "tp_models.py"))


@pytest.fixture(scope="session")
def registry():
    """The default registry with opzoo and the test fixtures' operators."""
    return load_modules(MODULES)


@pytest.fixture(scope="session")
def gang(registry):
    """Four ranks serving world sizes 2 and 4 for the whole session."""
    with Gang(4, MODULES, (2, 4)) as g:
        yield g
