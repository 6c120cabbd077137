"""The mutation runner's reduced selection is rows ``python -m verify all`` runs by default, so a
mutant it kills is killed by ``verify all``; its results table names the row that killed each one."""
from __future__ import annotations

import json

from nnscaler.policies import POLICIES
from tests.mutants.run import first_failure, parser, write_results
from verify.cli import DEFAULT_WORLD_SIZES, build_parser
from verify.models.registry import MODELS
from verify.worker import load_modules


def test_the_reduced_selection_is_a_subset_of_the_default_verify_all():
    mine, full = parser().parse_args([]), build_parser().parse_args(["all"])
    assert full.op is None and full.model is None  # every registered operator and every model
    assert set(mine.op) <= {spec.name for spec in load_modules(())}
    assert set(mine.model) <= set(MODELS)
    full_sizes = list(DEFAULT_WORLD_SIZES) if full.world_size is None else full.world_size  # None: the default sizes
    assert mine.world_size == full_sizes and mine.random_seeds == full.random_seeds
    assert mine.timeout == full.timeout and full.seed == [0] and len(POLICIES) >= 6  # every policy, both


def test_the_first_failing_row_is_named_in_the_results_table(tmp_path):
    rows = [{"op": "relu", "world_size": 2, "partition": "*0=2", "seed": 0, "status": "match", "detail": ""},
            {"op": "model:nanogpt", "world_size": 4, "partition": "tp", "seed": 0, "status": "MISMATCH",
             "detail": "grad a|b step 0 on rank 1: error 0.5 > tolerance 1e-6"}]
    (tmp_path / "cases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    killer = first_failure(tmp_path)
    assert killer.startswith("model:nanogpt W=4 tp seed 0: MISMATCH, grad a|b step 0")
    assert first_failure(tmp_path / "none") == ""
    out = tmp_path / "RESULTS.md"
    write_results(str(out), {"a": ("killed", 12.3, killer), "b": ("survived", 99.0, "tail")}, ["--model", "nanogpt"])
    text = out.read_text()
    assert "| a | killed | model:nanogpt W=4 tp seed 0: MISMATCH, grad a/b" in text
    assert "| b | survived |  | 99 |" in text and "Kill rate: 1/2 = 50%." in text
