"""A float64 run of a model with float32 islands is judged against a float64 reference that promotes
them (``verify/judge/compare.py``): Mistral-, Falcon- and OPT-like models match under random plans in
float64 (they false-alarmed: errors ~1e-8 against bounds ~5e-16), XGLM (a default-dtype constant of
``finfo(float64).min``) verifies at all, and a wrong program still fails in float64."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parents[1] / "fixtures"
ISLANDS = FIXTURES / "float32_islands.py"


def verify(*args):
    return subprocess.run([sys.executable, "-m", "verify", "model", *args, "--world-size", "2", "--steps", "2"],
                          capture_output=True, text=True, timeout=1800)


def _sweep(model: str, seeds: list[str]):
    out = verify(f"{ISLANDS}:{model}", "--policy", "random", "random2d", "--dtype", "float64", "--seed", *seeds)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert f"{2 * len(seeds)} cases, {2 * len(seeds)} match" in out.stdout


@pytest.mark.parametrize("model", ["mistral", "falcon", "opt"])
def test_float32_islands_match_in_float64(model):
    _sweep(model, ["0"])


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mistral", "falcon", "opt"])
def test_float32_islands_match_in_float64_over_5_seeds(model):
    _sweep(model, ["0", "1", "2", "3", "4"])


def test_xglm_verifies():
    out = verify(f"{ISLANDS}:xglm", "--policy", "dp", "tp", "random")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "3 cases, 3 match" in out.stdout


def test_a_wrong_program_still_fails_in_float64():
    out = verify("wrong_softmax_head", "--policy", "tp", "--dtype", "float64", "--module", str(FIXTURES / "wrong_model.py"))
    assert out.returncode == 1 and "MISMATCH" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]
