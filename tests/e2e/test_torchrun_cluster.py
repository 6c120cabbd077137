"""``verify model`` on the ranks of a torchrun job of two "nodes" (two launchers of
``python -m verify.torchrun`` on the loopback interface, 2 ranks each, world size 4): rank 0 judges
the rows as ``python -m verify model`` does (a right plan matches, a known-wrong program is a
MISMATCH naming its operator, exit 1), bad input is one line and exit 2 with every rank exiting
cleanly, and every socket the job listens on is bound to 127.0.0.1."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verify.runner.gang import free_port
from verify.runner.isolation import descendants
from verify.torchrun import command

ROOT = Path(__file__).parents[2]
WRONG = ROOT / "tests" / "fixtures" / "wrong_model.py"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _listening(pids: set[int]) -> set[str]:
    """Local addresses of the TCP sockets ``pids`` listen on (``ss -ltnp``)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    return {line.split()[3] for line in out.splitlines()
            if pids & {int(p) for p in re.findall(r"pid=(\d+)", line)}}


def two_nodes(args: list[str], tmp: Path, timeout_s: float = 600) -> tuple[list[subprocess.CompletedProcess], set]:
    """Run ``-m verify.cluster ARGS`` as 2 nodes x 2 ranks; (node 0's and node 1's results, the
    addresses the job listened on)."""
    port = free_port()
    procs, logs = [], []
    for node in (0, 1):
        out, err = open(tmp / f"node{node}.out", "w+"), open(tmp / f"node{node}.err", "w+")
        logs.append((out, err))
        procs.append(subprocess.Popen(command(["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
                                               "-m", "verify.cluster", *args], port=port),
                                      stdout=out, stderr=err, text=True, env=ENV, cwd=ROOT))
    addresses, deadline = set(), time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            tree = {q for p in procs for q in [p.pid, *descendants(p.pid)]}
            addresses |= _listening(tree)
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    results = []
    for p, (out, err) in zip(procs, logs):
        out.seek(0), err.seek(0)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
        out.close(), err.close()
    return results, addresses


def test_two_nodes_verify_a_model_listening_on_127_0_0_1_only(tmp_path):
    """tp of weightnorm_mlp on 4 ranks of two nodes matches: rank 0 prints the rows and writes the
    reports; the job listens on the loopback interface only."""
    (node0, node1), addresses = two_nodes(["model", "weightnorm_mlp", "--policy", "tp", "--steps", "2",
                                           "--gen-dir", str(tmp_path / "gen"), "--json", str(tmp_path / "rows.json"),
                                           "--reports", str(tmp_path / "reports")], tmp_path)
    assert node0.returncode == 0, node0.stdout[-3000:] + node0.stderr[-3000:]
    assert node1.returncode == 0, node1.stderr[-3000:]
    (row,) = json.loads((tmp_path / "rows.json").read_text())
    assert (row["world_size"], row["partition"], row["status"]) == (4, "tp", "match"), row
    assert "training weightnorm_mlp" in node0.stdout and "1 cases, 1 match" in node0.stdout
    assert "training" not in node1.stdout  # rank 0 alone drives and prints
    assert json.loads((tmp_path / "reports" / "cases.jsonl").read_text().splitlines()[0])["status"] == "match"
    assert addresses and all(a.rsplit(":", 1)[0] == "127.0.0.1" for a in addresses), addresses


def test_two_nodes_catch_a_wrong_program(tmp_path):
    """tp splits wrong_softmax_head's wrong row softmax across rows: a MISMATCH naming that operator,
    and node 0's launcher exits 1 (rank 0's code); node 1's exits 0 after a clean exit barrier."""
    (node0, node1), _ = two_nodes(["model", "wrong_softmax_head", "--policy", "tp", "--steps", "1",
                                   "--module", str(WRONG), "--gen-dir", str(tmp_path / "gen"),
                                   "--json", str(tmp_path / "rows.json")], tmp_path)
    assert node0.returncode == 1, node0.stdout[-3000:] + node0.stderr[-3000:]
    (row,) = json.loads((tmp_path / "rows.json").read_text())
    assert row["world_size"] == 4 and row["status"] == "MISMATCH" and "row_softmax" in row["detail"], row
    assert node1.returncode == 0 and "exit barrier" not in node1.stderr, node1.stderr[-3000:]


def test_two_nodes_refuse_bad_input_in_one_line(tmp_path):
    """Several nodes need a --gen-dir every node sees: exit 2 with one line on rank 0, every rank exits 0."""
    (node0, node1), _ = two_nodes(["model", "weightnorm_mlp", "--policy", "tp"], tmp_path)
    assert node0.returncode == 2, node0.stdout[-2000:] + node0.stderr[-2000:]
    errors = [line for line in node0.stderr.splitlines() if line.startswith("verify")]
    assert errors == [errors[0]] and "--gen-dir" in errors[0], node0.stderr
    assert node1.returncode == 0 and "Traceback" not in node0.stderr + node1.stderr, node1.stderr


def test_two_nodes_verify_a_saved_plan_at_its_own_size(tmp_path):
    """A plan made for 4 GPUs (tp 2 x dp 2 with ZeRO-1) runs --as-planned on the 4 ranks of two nodes and
    matches one device; on a job of another size it is refused in one line before any case runs."""
    pytest.importorskip("transformers")
    from tests.fixtures.llama_meta import saved_plan
    _, path = saved_plan(tmp_path, 4, {"tp": 2, "pp": 1, "dp": 2, "zero": 1})
    (node0, node1), _ = two_nodes(["plan", str(path), "--as-planned", "--steps", "2", "--precision", "32-true",
                                   "--keep", str(tmp_path / "keep")], tmp_path)
    assert node0.returncode == 0, node0.stdout[-3000:] + node0.stderr[-3000:]
    assert node1.returncode == 0, node1.stderr[-3000:]
    assert re.search(r"verifying it as tp2(\+sp)? pp1 dp2 .* on 4 ranks", node0.stdout), node0.stdout[-3000:]
    assert "1 match" in node0.stdout, node0.stdout[-3000:]
    out = subprocess.run(command(["--nproc-per-node", "2", "-m", "verify.cluster", "plan", str(path), "--as-planned"]),
                         capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    errors = [line for line in out.stderr.splitlines() if line.startswith("verify")]
    assert out.returncode == 2 and len(errors) == 1 and "start torchrun with 4 ranks" in errors[0], out.stderr[-2000:]


def test_bad_launches_are_one_line_and_exit_2():
    out = subprocess.run([sys.executable, "-m", "verify.cluster", "model", "weightnorm_mlp"], capture_output=True,
                         text=True, env=ENV, cwd=ROOT, timeout=60)  # not under torchrun
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "torchrun" in out.stderr
    out = subprocess.run(command(["--nnodes", "2", "--nproc-per-node", "2", "-m", "verify.cluster", "model", "x"]),
                         capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)  # no --port for node 0
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [out.stderr.strip()] and "--port" in out.stderr


def test_a_case_past_its_limit_ends_the_job_in_one_line(tmp_path):
    """A torchrun job cannot restart its ranks: a hung case (faulty_hang sleeps when partitioned) ends
    the job at its --timeout with one line naming it, exit 1, rather than hanging."""
    out = subprocess.run(command(["--nproc-per-node", "2", "-m", "verify.cluster", "op", "faulty_hang", "--module",
                                  str(ROOT / "tests" / "fixtures" / "faulty_ops.py"), "--timeout", "5", "--base", "4"]),
                         capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    (line,) = [x for x in out.stderr.splitlines() if "within its limit" in x]
    assert line.startswith("verify.cluster: op faulty_hang a=2 at W=2 gave no answer within its limit of 5 s"), line
