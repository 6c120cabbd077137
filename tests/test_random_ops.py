"""A model that draws random numbers in training (dropout with p > 0) is reported ``unverifiable``,
naming the operator and the user's line, never a mismatch that blames the plan."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from nnscaler.trace.build import trace

FIXTURE = Path(__file__).parent / "fixtures" / "dropout_model.py"


def _dropout_graph(p: float, training: bool):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.drop = torch.nn.Linear(4, 4), torch.nn.Dropout(p)

        def forward(self, x):
            return self.drop(self.lin(x)).sum()
    m = M().train(training)
    return trace(m, (torch.randn(2, 4),))


def test_only_a_dropout_that_is_not_the_identity_draws_random_numbers():
    assert [op.draws_random for op in _dropout_graph(0.1, True).ops if "dropout" in op.overload] == [True]
    for p, training in ((0.0, True), (0.1, False)):
        assert not any(op.draws_random for op in _dropout_graph(p, training).ops)


def test_a_model_with_dropout_is_unverifiable_not_a_mismatch():
    out = subprocess.run([sys.executable, "-m", "verify", "model", f"{FIXTURE}:build", "--policy", "dp", "tp",
                          "--world-size", "2"], capture_output=True, text=True, timeout=600)
    assert "2 cases, 2 unverifiable" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]
    assert "MISMATCH" not in out.stdout and "dropout (aten.dropout.default) at" in out.stdout
    assert "dropout_model.py:" in out.stdout  # the user's line
