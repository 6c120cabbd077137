"""The harness builds a user's model afresh from its builder and never copies the object: a model
holding a ``torch.library`` op handle, a lock and a hook verifies like any other (it errored with
``cannot pickle`` when the harness deep-copied models), a wrong annotation of its operator is named,
and the printed rerun line of that operator runs as printed."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

FIXTURES = Path(__file__).parents[1] / "fixtures"
MODEL = FIXTURES / "op_handle_model.py"
POLICY = f"{FIXTURES / 'op_handle_policy.py'}:split_h"


def verify(*args):
    return subprocess.run([sys.executable, "-m", "verify", *args], capture_output=True, text=True, timeout=900)


def test_a_model_holding_an_op_handle_a_lock_and_a_hook_verifies():
    out = verify("model", f"{MODEL}:build", "--policy", "dp", "tp", POLICY, "--world-size", "2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "3 cases, 3 match" in out.stdout


def test_its_wrong_annotation_is_named_and_the_rerun_line_runs_as_printed():
    out = verify("model", f"{MODEL}:build_wrong", "--policy", POLICY, "--world-size", "2")
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-2000:]
    assert "first divergent operator: scaled_gelu_wrong" in out.stdout and "[h=2]" in out.stdout
    alone = re.search(r"alone: (python -m verify op [^|]*?)\s*\|", out.stdout).group(1)
    assert f"--module {MODEL}" in alone
    rerun = subprocess.run([sys.executable, *shlex.split(alone)[1:]], capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 1, rerun.stdout[-2000:] + rerun.stderr[-2000:]  # a mismatch, not bad input (2)
    assert "MISMATCH" in rerun.stdout


def test_the_bf16_spread_samples_run_the_model_itself_never_a_copy():
    """``--precision bf16-mixed`` samples the recipe's spread at moved points: on the models themselves,
    put back after (it errored with ``cannot pickle`` when the samples deep-copied the model)."""
    out = verify("model", f"{MODEL}:build", "--policy", "dp", "--world-size", "2", "--steps", "2",
                 "--precision", "bf16-mixed")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "1 cases, 1 match" in out.stdout


COPIED = {"single_opt.state_dict()", "cfg"}  # what verify/ may deep-copy: an optimizer's state, a model config


def test_no_model_is_deep_copied_or_pickled_anywhere_in_verify():
    root = Path(__file__).parents[2] / "verify"
    found = []
    for path in root.rglob("*.py"):
        text = path.read_text()
        found += [f"{path.relative_to(root)}: {m.group(0)}" for m in re.finditer(r"\bpickle\.\w+\(|\bcopy\.copy\(", text)]
        found += [f"{path.relative_to(root)}: deepcopy({m.group(1)})" for m in re.finditer(r"deepcopy\(([^()]*(?:\(\))?)\)", text)
                  if m.group(1) not in COPIED]
    assert not found, found
