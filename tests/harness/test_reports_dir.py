"""A second run into the same ``--reports`` directory: a finished run of the same command at the same
settings is replaced (one line says so); the rows of an unfinished run, of another command or other
settings are refused in one line naming the way out (``--resume``, ``--overwrite``, another
directory); ``report.md`` is titled and counted by what was run."""
from __future__ import annotations

import json

import pytest

from verify.config import RunConfig

from verify.judge.row import Row
from verify.cli import main
from verify.judge.verdict import MATCH
from verify.names import OVERWRITE
from verify.report.writer import ReportError, ReportWriter, load_rows

CFG = RunConfig(world_sizes=(2,))


def _row(op: str = "model:nanogpt", partition: str = "dp") -> Row:
    return Row(op, "model", "3 AdamW steps vs one device", 2, partition, "float32", 0, MATCH)


def _run(directory, command: str, rows, cfg: RunConfig = CFG, **kw) -> None:
    w = ReportWriter(directory, cfg, command=command, **kw)
    for r in rows:
        w.add(r)
    w.close()


def _interrupted(directory, command: str = "all") -> None:
    w = ReportWriter(directory, CFG, command=command)
    w.add(_row())
    with pytest.raises(KeyboardInterrupt):
        try:
            raise KeyboardInterrupt
        finally:
            w.close()


def test_a_finished_run_of_the_same_command_is_replaced_and_said(tmp_path, capsys):
    _run(tmp_path, "all", [_row(), _row(partition="tp")])
    capsys.readouterr()
    _run(tmp_path, "all", [_row()])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"verify: replacing the finished `python -m verify all` run in {tmp_path}")
    assert "(2 cases" in err[0] and len(load_rows(tmp_path)) == 1
    meta = json.loads((tmp_path / "report.json").read_text())
    assert meta["command"] == "all" and meta["complete"] is True


@pytest.mark.parametrize("before, now, needle", [
    ("model nanogpt", "model llama", "a `python -m verify model nanogpt` run; pass --overwrite"),
    ("model nanogpt", "all", "a `python -m verify model nanogpt` run; pass --resume to continue it, --overwrite"),
])
def test_rows_of_another_command_are_refused(tmp_path, before, now, needle):
    _run(tmp_path, before, [_row()])
    with pytest.raises(ReportError, match=needle.replace("(", r"\(")):
        ReportWriter(tmp_path, CFG, command=now)
    assert len(load_rows(tmp_path)) == 1  # nothing dropped
    _run(tmp_path, now, [_row(), _row(partition="tp")], resume=OVERWRITE)  # unless asked to
    assert len(load_rows(tmp_path)) == 2


def test_an_unfinished_run_is_refused_and_resumed_on_request(tmp_path):
    _interrupted(tmp_path)
    assert json.loads((tmp_path / "report.json").read_text())["complete"] is False
    with pytest.raises(ReportError, match=r"holds 1 case of an unfinished run; pass --resume to continue it"):
        ReportWriter(tmp_path, CFG)
    w = ReportWriter(tmp_path, CFG, resume=True)
    assert len(w.rows) == 1
    w.close()


def test_a_finished_run_at_other_settings_is_refused(tmp_path):
    _run(tmp_path, "all", [_row()])
    with pytest.raises(ReportError, match=r"other settings \(world_sizes \[2\] there, \[2, 4\] now.*\); pass --overwrite"):
        ReportWriter(tmp_path, RunConfig(world_sizes=(2, 4)))


def test_reports_written_before_the_command_was_recorded_count_as_a_finished_verify_all(tmp_path, capsys):
    """The committed ``reports/`` of a clean clone: ``python -m verify all`` replaces it, twice in a row."""
    _run(tmp_path, "all", [_row()])
    meta = json.loads((tmp_path / "report.json").read_text())
    del meta["command"], meta["complete"]
    (tmp_path / "report.json").write_text(json.dumps(meta))
    with pytest.raises(ReportError, match="a `python -m verify all` run"):
        ReportWriter(tmp_path, CFG, command="model nanogpt")
    _run(tmp_path, "all", [_row()])
    _run(tmp_path, "all", [_row()])
    assert capsys.readouterr().err.count("verify: replacing the finished") == 2


def test_the_cli_refuses_in_one_line_before_any_rank_starts(tmp_path, capsys):
    _run(tmp_path, "model llama", [_row("model:llama")])
    assert main(["model", "tests/fixtures/user_model.py:build", "--world-size", "2", "--policy", "dp",
                 "--reports", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a `python -m verify model llama` run; pass --overwrite" in err[0], err
    assert main(["all", "--resume", "--overwrite"]) == 2
    assert "not allowed with argument --resume" in capsys.readouterr().err


def test_a_model_report_is_titled_and_counted_by_what_ran(tmp_path):
    _run(tmp_path, "model nanogpt", [_row(), _row(partition="tp")])
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# Model verification report") and "1 model, 2 cases" in md and "operators" not in md.split("##")[0]
    _run(tmp_path / "mixed", "all", [_row(), Row("linear", "linalg", "m k+, n k+ -> m n", 2, "m=2", "float32", 0, MATCH)])
    md = (tmp_path / "mixed" / "report.md").read_text()
    assert md.startswith("# Operator and model verification report") and "1 operator, 1 model, 2 cases" in md


def test_a_finished_model_run_with_another_policy_or_steps_is_refused_before_any_rank(tmp_path, capsys):
    """``verify model`` records its policies, steps and recipe: a second run that differs in any is
    refused in one line naming the setting (exit 2), and the first run's rows stay."""
    base = ["model", "tests/fixtures/user_model.py:build", "--world-size", "2", "--reports", str(tmp_path)]
    assert main(base + ["--policy", "dp", "--steps", "1"]) == 0
    before = (tmp_path / "cases.jsonl").read_text()
    capsys.readouterr()
    for more, needle in ((["--policy", "tp", "--steps", "1"], "policies ['dp'] there, ['tp'] now"),
                         (["--policy", "dp", "--steps", "2"], "steps 1 there, 2 now"),
                         (["--policy", "dp", "--steps", "1", "--zero", "1"], "zero 0 there, 1 now")):
        assert main(base + more) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0] and "pass --overwrite to replace it, or another --reports" in err[0], err
        assert (tmp_path / "cases.jsonl").read_text() == before
    assert not (tmp_path / ".lock").exists()


@pytest.mark.parametrize("name, text", [("report.json", '{"mine": 1}\n'), ("report.json", "not json"),
                                        ("report.md", "# my notes\n"), ("cases.jsonl", "my own lines\n")])
@pytest.mark.parametrize("resume", [False, True, OVERWRITE])
def test_files_verify_did_not_write_are_never_overwritten(tmp_path, name, text, resume):
    (tmp_path / name).write_text(text)
    with pytest.raises(ReportError, match=f"holds .*{name}.* that verify did not write; move"):
        ReportWriter(tmp_path, CFG, resume=resume)
    assert (tmp_path / name).read_text() == text and {p.name for p in tmp_path.iterdir()} == {name}


def test_the_lock_file_does_not_outlive_the_run(tmp_path):
    w = ReportWriter(tmp_path, CFG)
    assert (tmp_path / ".lock").read_text() == str(__import__("os").getpid())
    with pytest.raises(ReportError, match="in use by another run"):
        ReportWriter(tmp_path, CFG)
    assert (tmp_path / ".lock").exists()  # the refused run leaves the holder's lock alone
    w.add(_row())
    w.close()
    assert not (tmp_path / ".lock").exists()
    with pytest.raises(ReportError, match="other settings"):  # refused after locking: unlocked again
        ReportWriter(tmp_path, RunConfig(world_sizes=(4,)))
    assert not (tmp_path / ".lock").exists()
    _run(tmp_path, "all", [_row()])  # and the next run takes the directory
    assert not (tmp_path / ".lock").exists()
