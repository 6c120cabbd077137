"""``python -m verify`` as a user runs it: exit codes, one-line errors, tables, reports, rerun commands."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from verify.judge.verdict import MATCH

from verify.config import RunConfig

from verify.judge.row import Row
from verify.cli import main
from verify.report.writer import ReportWriter, load_rows

ROOT = Path(__file__).resolve().parents[2]
WRONG = str(ROOT / "tests" / "fixtures" / "wrong_ops.py")
MALFORMED = str(ROOT / "tests" / "fixtures" / "malformed_ops.py")


def verify(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "verify", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args,needle", [
    (["op", "linaer"], "did you mean linear"),
    (["op", "linear", "--world-size", "0"], "world size"),
    (["op", "linear", "--dtype", "float8"], "--dtype"),
    (["op", "linear", "--partition", "zz=2", "--world-size", "2"], "'zz' is not a splittable identifier"),
    (["op", "malformed", "--module", MALFORMED], "column 3: unclosed '('"),
    (["op", "linear", "--module", "no/such/file.py"], "no such file"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_exits_2_with_one_line(args, needle, capsys):
    assert main(args) == 2  # the entry point of ``python -m verify``, in-process (no torch re-import)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines


def test_bad_input_from_the_shell():
    r = verify("op", "linaer")
    assert r.returncode == 2 and r.stderr.strip().startswith("verify: error: unknown operator 'linaer'; did you mean linear")
    assert len(r.stderr.strip().splitlines()) == 1


def test_mismatch_exits_1_and_its_rerun_command_reproduces_it():
    r = verify("op", "wrong_cumsum", "--module", WRONG, "--world-size", "2", "4", "--seed", "3")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "MISMATCH" in r.stdout and "match" in r.stdout
    rerun = next(line for line in r.stdout.splitlines() if "MISMATCH" in line).split("|")[-2].strip()
    assert rerun.startswith("python -m verify op wrong_cumsum")
    again = subprocess.run(shlex.split(rerun.replace("python", shlex.quote(sys.executable), 1)), cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and again.stdout.count("MISMATCH") == 2  # the row's line and the summary


def test_match_exits_0_and_writes_json(tmp_path):
    out = tmp_path / "rows.json"
    r = verify("op", "right_reshape", "--module", WRONG, "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    assert rows and all(row["status"] == MATCH for row in rows)
    assert {row["world_size"] for row in rows} == {2, 4}


def test_list_shows_annotations():
    r = verify("list")
    assert r.returncode == 0
    assert "b m k+, b k+ n -> b m n" in r.stdout.replace("`", "") or "k+" in r.stdout


def test_all_writes_every_report_and_resumes(tmp_path):
    args = ["all", "--module", WRONG, "--op", "wrong_flip", "right_rowscale", "--model", "--world-size", "2",
            "--reports", str(tmp_path)]
    r = verify(*args)
    assert r.returncode == 1, r.stdout + r.stderr
    rows = load_rows(tmp_path)
    assert {row.op for row in rows} == {"wrong_flip", "right_rowscale"}
    assert any(row.status == "MISMATCH" for row in rows)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["summary"]["cases"] == len(rows)
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    assert int(suite.get("tests")) == len(rows) and int(suite.get("failures")) >= 1
    assert "## Failures" in (tmp_path / "report.md").read_text()
    again = verify(*args, "--resume")
    assert len(load_rows(tmp_path)) == len(rows), again.stdout  # nothing run twice


def test_rows_are_written_the_moment_they_are_known(tmp_path):
    w = ReportWriter(tmp_path, RunConfig())
    w.add(Row("op", "fam", "a -> a", 2, "a=2", "float32", 0, MATCH))
    assert len(load_rows(tmp_path)) == 1  # before any flush or close
    w.close()
