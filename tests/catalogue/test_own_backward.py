"""An operator's own backward (``register_autograd``, a ``torch.autograd.Function``) is checked against
its forward: the ranks compare it with the single-device run of the same backward, which cannot
catch it, so ``verify lint`` and ``verify op`` run ``gradcheck`` on it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = str(Path(__file__).parents[1] / "fixtures" / "own_backward_ops.py")


def verify(*args):
    return subprocess.run([sys.executable, "-m", "verify", *args, "--module", FIXTURE], capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("op, wrong", [("scale3_wrong_bwd", True), ("cube_wrong_bwd", True),
                                       ("scale3_right_bwd", False)])
def test_lint_checks_an_own_backward(op, wrong):
    out = verify("lint", op)
    assert out.returncode == (1 if wrong else 0), out.stdout + out.stderr
    assert ("own backward disagrees with its forward" in out.stdout) == wrong


def test_verify_op_fails_a_wrong_own_backward():
    out = verify("op", "scale3_wrong_bwd", "--world-size", "2")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "own backward (gradcheck)" in out.stdout and "MISMATCH" in out.stdout
    assert "python -m verify lint scale3_wrong_bwd --module" in out.stdout
