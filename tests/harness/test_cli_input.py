"""Bad command-line input is one line and exit 2 before any rank starts; ``--version`` answers."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from verify.cli import main

ROOT = Path(__file__).resolve().parents[2]
SIBLING = "tests/fixtures/sibling_model/model.py"


@pytest.mark.parametrize("argv, what", [
    (["op", "linear", "--timeout", "1e-9"], "--timeout must be at least 1"),
    (["op", "linear", "--partition", ""], "--partition must not be empty"),
    (["op", "linear", "--seed", "99999999999999999999999"], "--seed must be between 0 and"),
    (["op", "linear", "--seed", "-1"], "--seed must be between 0 and"),
    (["op", "linear", "--seed", str(2 ** 63)], "--seed must be between 0 and 9223372036854775807"),
    (["op", "linear", "--timeout", "0.5"], "--timeout must be at least 1"),
    (["op", "linear", "--partition", "  "], "--partition must not be empty"),
    (["model", "nanogpt", "--timeout", "nan"], "--timeout must be a finite number above 0"),
    (["all", "--resume", "--overwrite"], "not allowed with argument --resume"),
    (["model", f"{SIBLING}:build@0"], "the width after '@' must be a positive integer, got '0'"),
    (["model", f"{SIBLING}:build_fixed@16"], "build_fixed takes no width; define build_fixed(seed, width)"),
])
def test_bad_input_is_one_line_and_exit_2(argv, what, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and what in err[0], err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("python -m verify ")


def _module(tmp_path, annotation: str) -> str:
    path = tmp_path / "bad_ops.py"
    path.write_text(f"import torch\nfrom nnscaler import register_op\n"
                    f"register_op({annotation!r}, 'bad', family='test')(torch.neg)\n")
    return str(path)


@pytest.mark.parametrize("annotation, what", [
    ("a 0 -> a 0", "column 3: a dimension of length 0 has nothing to verify"),
    ("", "annotation '', column 1"),
])
def test_an_empty_annotation_or_dim_is_one_line_and_exit_2(annotation, what, tmp_path, capsys):
    assert main(["op", "bad", "--module", _module(tmp_path, annotation)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and what in err[0], err


@pytest.mark.parametrize("annotation, what", [
    ("a b -> c", "tensor has 2 dims but the annotation names 1"),  # 'a' and 'b' consumed: AnnotationWarnings
    ("a, b -> a", "the annotation must name one input per argument"),
    ("a b -> ", "tensor has 2 dims but the annotation names 0"),
])
def test_a_malformed_annotation_is_one_line_without_warnings(annotation, what, tmp_path):
    """Refused by rank 0's sampling: neither the harness nor a rank prints the import's warnings first."""
    r = subprocess.run([sys.executable, "-m", "verify", "op", "bad", "--module", _module(tmp_path, annotation),
                        "--world-size", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and what in err[0], r.stderr


def test_a_builder_beside_its_modules_runs_at_a_width_with_one_line_per_plan():
    """``FILE.py:builder@WIDTH`` imports its sibling module in the harness and in every rank; each plan
    is one line, and its PlanWarning is said once, at the model's class, not at harness lines."""
    r = subprocess.run([sys.executable, "-m", "verify", "model", f"{SIBLING}:build@16", "--world-size", "2",
                        "--policy", "tp", "dp"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    plans = [line for line in r.stdout.splitlines() if line.startswith("plan ")]
    assert [p.split()[1] for p in plans] == ["tp", "dp"], r.stdout
    assert "(2.1 KiB of 2.1 KiB)" in plans[0], plans[0]  # built at width 16: (16 x 16 + 16 + 16 x 16) x 4 bytes
    warned = [line for line in r.stderr.splitlines() if "PlanWarning" in line]
    assert len(warned) == 1 and warned[0].startswith(f"{ROOT / 'tests/fixtures/sibling_model/model.py'}:"), r.stderr
    assert "verify/" not in r.stderr and "operators replicated" not in r.stdout, r.stdout + r.stderr
