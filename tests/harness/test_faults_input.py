"""Bad input is exit 2 in one line before work starts; reports survive concurrency and interruption;
generated code is not run on trust; nothing listens beyond the loopback interface (issue #11
items 5-8)."""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from verify.judge.verdict import ERROR, MATCH, MISMATCH

from verify.config import RunConfig

from verify.judge.row import Row
from verify.cli import main
from verify.runner.gang import max_ranks
from verify.report.writer import CASES_FILE, ReportError, ReportWriter, load_rows

from conftest import FIXTURES

ROOT = Path(__file__).resolve().parents[2]
BAD = str(FIXTURES / "bad_ops.py")
WRONG = str(FIXTURES / "wrong_ops.py")


def one_line_error(capsys, args) -> str:
    assert main(args) == 2, args
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if not line.startswith("verify: warning: ")]  # lint may warn first
    assert len(errors) == 1 and errors[0].startswith("verify: error: "), lines
    return errors[0]


# -- 8. bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("args,needle", [
    (["op", "linear", "--timeout", "nan"], "--timeout"),
    (["op", "linear", "--timeout", "0"], "--timeout"),
    (["op", "linear", "--timeout", "-3"], "--timeout"),
    (["model", "nanogpt", "--steps", "0"], "--steps"),
    (["op", "linear", "--rank-memory", "0"], "--rank-memory"),
    (["op", "linear", "--base", "0"], "--base"),
    (["op", "linear", "--world-size", str(max_ranks() + 1)], f"between 1 and {max_ranks()}"),
    (["op", "linear", "--module", str(FIXTURES / "exit_module.py")], "sys.exit(0)"),
    (["op", "bad_arity_py", "--module", BAD], "names 2 inputs"),
    (["op", "bad_tolerance", "--module", BAD], "tolerance factor=-1.0"),
    (["op", "bad_zero_length", "--module", BAD], "lengths must be positive"),
    (["op", "linear", "--json", "/dev/full"], "--json /dev/full"),
    (["op", "linear", "--json", "/no/such/dir/rows.json"], "--json"),
])
def test_bad_input_is_refused_before_any_rank_starts(capsys, args, needle):
    assert needle in one_line_error(capsys, args)


@pytest.mark.parametrize("name,needle", [("bad_arity", "one input per argument"), ("bad_outputs", "names 2 outputs"), ("bad_rank", "annotation names 3"),
                                         ("bad_shape", "'a' is")])
def test_an_annotation_that_disagrees_with_its_function_is_bad_input(capsys, name, needle):
    line = one_line_error(capsys, ["op", name, "--module", BAD, "--world-size", "2"])
    assert needle in line and name in line


def test_a_busy_reports_dir_is_refused_up_front(capsys, tmp_path):
    holder = ReportWriter(tmp_path, RunConfig(world_sizes=(2,)))  # another run writing there
    try:
        line = one_line_error(capsys, ["all", "--op", "linear", "--model", "--world-size", "2", "--reports",
                                       str(tmp_path)])
        assert "in use by another run" in line
    finally:
        holder.close()


@pytest.mark.parametrize("target", ["file", "under-file"])
def test_an_unusable_reports_dir_is_one_line(capsys, tmp_path, target):
    (tmp_path / "f").write_text("")
    where = tmp_path / "f" if target == "file" else tmp_path / "f" / "sub"
    line = one_line_error(capsys, ["all", "--op", "linear", "--model", "--reports", str(where)])
    assert str(where) in line


def test_a_full_disk_is_one_line(tmp_path):
    def tiny_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    r = subprocess.run([sys.executable, "-m", "verify", "all", "--op", "linear", "--model", "--world-size", "2",
                        "--reports", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       preexec_fn=tiny_files)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "too large" in r.stderr or "space" in r.stderr


# -- 7. reports -----------------------------------------------------------------------------------
def _row(i: int, status: str = MATCH, dtype: str = "float32") -> Row:
    return Row(f"op{i}", "fam", "a -> a", 2, "a=2", dtype, 0, status)


def test_resume_drops_a_cut_off_line_and_keeps_each_case_once(tmp_path):
    cfg = RunConfig(world_sizes=(2,))
    w = ReportWriter(tmp_path, cfg)
    for i in range(3):
        w.add(_row(i))
    w.add(_row(3, ERROR))
    w.add(_row(0))  # a duplicate
    w.close()
    with open(tmp_path / CASES_FILE, "a") as f:
        f.write('{"op": "op9", "family": "fa')  # killed mid-line
    w = ReportWriter(tmp_path, cfg, resume=True)
    assert sorted(r.op for r in w.rows) == ["op0", "op1", "op2"]  # the error row runs again
    w.add(_row(3))
    w.close()
    lines = (tmp_path / CASES_FILE).read_text().splitlines()
    assert [json.loads(line)["op"] for line in lines] == ["op0", "op1", "op2", "op3"]


def test_resume_with_other_settings_is_refused(tmp_path):
    ReportWriter(tmp_path, RunConfig(world_sizes=(2,))).close()
    with pytest.raises(ReportError, match="dtype float32 there, float64 now"):
        ReportWriter(tmp_path, RunConfig(world_sizes=(2,), dtype="float64"), resume=True)


def test_a_second_writer_is_refused_and_the_first_loses_nothing(tmp_path):
    w = ReportWriter(tmp_path, RunConfig())
    with pytest.raises(ReportError, match="in use"):
        ReportWriter(tmp_path, RunConfig())
    for i in range(50):
        w.add(_row(i))
    w.close()
    assert len(load_rows(tmp_path)) == 50


def test_junit_has_a_timestamp_and_a_hostname(tmp_path):
    w = ReportWriter(tmp_path, RunConfig())
    w.add(_row(0, MISMATCH))
    w.close()
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    assert suite.get("timestamp") and suite.get("hostname")


# -- 6. generated code ----------------------------------------------------------------------------
def test_generated_code_is_not_run_on_trust(tmp_path):
    r = subprocess.run([sys.executable, str(FIXTURES / "codegen_trust_script.py"), str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "TRUST OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def test_two_jobs_sharing_gen_savedir_never_see_each_others_half_written_program(tmp_path):
    from nnscaler.compile.artifacts import import_program, save_program
    code = ("from nnscaler.compile.artifacts import import_program, save_program\nimport sys\nfrom pathlib import Path\n"
            "d, me = Path(sys.argv[1]), sys.argv[2]\n"
            "for i in range(200):\n"
            "    src = f'WHO = {me!r}\\nPAD = {\"x\" * 200000!r}\\n'\n"
            "    assert import_program(src, save_program(d, 0, src, True), 0).WHO == me\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), who], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
             for who in ("a", "b")]
    seen = set()
    while any(p.poll() is None for p in procs):
        text = (tmp_path / "plan_rank_0.py").read_text() if (tmp_path / "plan_rank_0.py").exists() else ""
        if text:
            seen.add(len(text))
    assert [p.returncode for p in procs] == [0, 0]
    assert len(seen) <= 1  # the file was only ever whole (both programs have one length)


# -- 5. loopback ----------------------------------------------------------------------------------
def _listening(pids: set[int]) -> list[str]:
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout
    return [line.split()[3] for line in out.splitlines() if any(f"pid={p}," in line for p in pids)]


@pytest.mark.skipif(subprocess.run(["which", "ss"], capture_output=True).returncode != 0, reason="needs ss")
def test_the_gang_listens_on_loopback_only(gang):
    from verify.runner import isolation
    pids = {os.getpid(), *gang.pids}
    pids |= {c for p in list(pids) for c in isolation.descendants(p)}
    addrs = _listening(pids)
    wide = [a for a in addrs if not a.startswith(("127.0.0.1:", "[::1]:"))]
    assert addrs and not wide, (wide, addrs)
