"""The torchtitan matrix's user file (``bench/studies/titan_user.py``) on two of its rows that no other test runs:
torchtitan's own context parallelism (attention wrapped by ``parallelize_llama``, inputs cut by its
``prepare_context_parallel_input``, the ring run through the CPU flash kernel) and its ``pipeline_llm`` composed
with tensor parallelism. The whole matrix is ``python bench/studies/titan_matrix.py`` (reports/titan_matrix.md)."""
from __future__ import annotations

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is the 'titan' extra (pip install -e '.[test]' has it)")

from bench.studies.titan_matrix import MATRIX, report, run  # noqa: E402


@pytest.mark.parametrize("name", ["CP", "PP x TP+SP"])
def test_a_row_of_the_matrix_matches_one_device(name):
    (row,) = run([c for c in MATRIX if c.name == name], timeout_s=60.0)
    assert row["status"] == "match", row["detail"]
    if name == "CP":
        assert "ring attention (torch's context_parallel) run through the CPU flash-attention kernel" in row["detail"]
    assert f"| {name} |" in report([row], "cmd", 1.0)
