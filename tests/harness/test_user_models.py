"""A user's own model from the command line: ``verify model FILE.py:builder``; bad references are one
line and exit 2 before any rank starts; a rerun line reproduces the row; ``op`` and ``model`` write
the same reports as ``all``."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from verify.cli import main
from verify.kinds.model import Model

ROOT = Path(__file__).resolve().parents[2]
USER = str(ROOT / "tests" / "fixtures" / "user_model.py")


@pytest.mark.parametrize("ref,needle", [
    (f"{USER}:nope", "has no function 'nope'"),
    (f"{USER}:not_a_case", "must return a ModelCase(model, batch_fn) or a pair"),
    (f"{USER}:wrong_batch", "the model does not accept its batch"),
    ("no/such/file.py:build", "no such file"),
    ("my_model", "or FILE.py:BUILDER[@WIDTH] where BUILDER(seed[, WIDTH]) returns"),
])
def test_bad_model_references_exit_2_in_one_line(ref, needle, capsys):
    assert main(["model", ref]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines


def test_a_user_model_verifies_and_writes_reports(tmp_path, capsys):
    code = main(["model", f"{USER}:build", "--policy", "dp", "--world-size", "2", "--steps", "2",
                 "--reports", str(tmp_path), "--json", str(tmp_path / "rows.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [(r["op"], r["partition"], r["status"]) for r in rows] == [(f"model:{USER}:build", "dp", "match")]
    assert {p.name for p in tmp_path.iterdir()} >= {"cases.jsonl", "report.json", "report.md", "junit.xml",
                                                    "report.html"}


def test_the_rerun_line_of_a_model_row_reproduces_it(tmp_path):
    from verify.config import RunConfig
    cfg = RunConfig(world_sizes=(2,), dtype="float64", modules=(str(ROOT / "tests" / "fixtures" / "wrong_model.py"),))
    line = Model.rerun_command(cfg, "wrong_softmax_head", "tp", 2, 3, 1)
    argv = shlex.split(line)
    assert argv[:3] == ["python", "-m", "verify"]
    assert main(argv[3:] + ["--json", str(tmp_path / "r.json")]) == 1  # the wrong model mismatches again
    (row,) = json.loads((tmp_path / "r.json").read_text())
    assert (row["partition"], row["world_size"], row["seed"], row["dtype"]) == ("tp", 2, 3, "float64")
