"""A ``--rank-memory`` cap below what a bare rank holds is refused before any case (exit 2), instead of
rows that pass or crash by the timing of a sampler."""
from __future__ import annotations

import subprocess
import sys

import pytest

from verify.runner.gang import Gang, MemoryCapError


def test_the_cli_refuses_a_cap_below_a_bare_rank():
    out = subprocess.run([sys.executable, "-m", "verify", "op", "add", "--world-size", "2", "--rank-memory", "20"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "--rank-memory 20 MiB is below what a bare rank holds" in out.stderr


def test_the_gang_refuses_it_at_start_and_leaves_no_rank():
    gang = Gang(2, memory_mb=20)
    with pytest.raises(MemoryCapError):
        gang.start()
    assert all(not p.is_alive() for p in gang._procs)
