"""A model that draws random numbers in training (dropout with p > 0) is verified: every forward of a
step draws from one generator state and dropout's kernel draws the whole tensor's mask on each rank,
so its masks are one device's; a split that draws per shard is caught, at the operator and in the
model. Where the ranks see the batch in pieces (micro-batches, replicas) the row is ``unverifiable``,
naming the operator and the user's line, never a mismatch that blames the plan."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from nnscaler.trace.build import trace

FIXTURE = Path(__file__).parents[1] / "fixtures" / "dropout_model.py"


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


WRONG = Path(__file__).parents[1] / "fixtures" / "split_dropout.py"


def _verify(*argv: str) -> str:
    out = subprocess.run([sys.executable, "-m", "verify", *argv], capture_output=True, text=True, timeout=600)
    return out.stdout + out.stderr[-2000:]


def test_a_model_with_dropout_matches_and_dp_keeps_it_data_parallel():
    import warnings
    from nnscaler import ComputeConfig, plan_model
    sys.path.insert(0, str(FIXTURE.parent))
    try:
        from dropout_model import build
    finally:
        sys.path.remove(str(FIXTURE.parent))
    model, batch = build(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_model(model.train(), batch(0), "dp", ComputeConfig(2), verify=False)
    assert plan.stats.replicated_ops == [] and "1 fwd" in plan.stats.one_line(plan)  # the loss only
    out = _verify("model", f"{FIXTURE}:build", "--policy", "dp", "tp", "random", "--world-size", "2")
    assert "3 cases, 3 match" in out, out[-3000:]


def test_micro_batches_make_a_model_with_dropout_unverifiable_not_a_mismatch():
    out = _verify("model", f"{FIXTURE}:build", "--policy", "dp", "--world-size", "2", "--microbatches", "2")
    assert "unverifiable" in out and "MISMATCH" not in out, out[-3000:]
    assert "dropout (aten.dropout.default) at" in out and "dropout_model.py:" in out  # the op and the user's line


def test_dropout_split_per_shard_is_caught_in_the_model_and_at_the_operator():
    out = _verify("model", f"{FIXTURE}:build", "--policy", "dp", "--world-size", "2", "--module", str(WRONG))
    assert "1 cases, 1 MISMATCH" in out, out[-3000:]
    out = _verify("op", "shard_draw_dropout", "--world-size", "2", "--module", str(WRONG))
    assert "3 cases, 1 match, 2 MISMATCH" in out, out[-3000:]  # only the replicated run draws one device's mask

