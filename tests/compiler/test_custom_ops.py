"""Graph corner cases the compiler must not get silently wrong: lifted constants and in-place writes
(``t[..., 0] = scalar``), custom ``autograd.Function``s, and ``register_op`` on plain functions."""
from __future__ import annotations

import pytest

from verify.judge.verdict import MATCH
from verify.models.registry import MODELS


def _rows(verify_model, name, policies, world_sizes=(2,), steps=2):
    """Through the plugin: one subtest per (world size, policy, seed), each failing on a mismatch."""
    return [(r.world_size, r.partition, r.status, r.detail)
            for r in verify_model(name, policies=list(policies), world_sizes=list(world_sizes), steps=steps)]


def test_a_scalar_written_into_a_slice_compiles_and_matches_under_every_policy(verify_model):
    rows = _rows(verify_model, "lifted_constant", ("dp", "tp", "hybrid", "random"), (2, 4))
    assert [r for r in rows if r[2] != MATCH] == [] and len(rows) == 8


def test_t5_with_labels_compiles_and_matches_under_every_policy(verify_model):
    pytest.importorskip("transformers")
    rows = _rows(verify_model, "t5_labels", ("dp", "tp", "hybrid", "random"), steps=1)
    assert [r for r in rows if r[2] != MATCH] == [] and len(rows) == 4


def test_registered_autograd_functions_and_functions_stay_one_operator_and_match(verify_model):
    import opzoo  # noqa: F401
    from nnscaler.trace.build import trace
    case = MODELS["custom_backward"](0)
    ops = [op.overload for op in trace(case.model, case.batch(0)).ops]
    assert {"nnscaler_user.test_ste_round.default", "nnscaler_user.test_clipped_tanh.default",
            "nnscaler_user.test_scaled_gelu.default"} <= set(ops)
    assert "aten.round.default" not in ops and "aten.tanh.default" not in ops  # not inlined
    rows = _rows(verify_model, "custom_backward", ("dp", "tp", "hybrid", "random"))
    assert [r for r in rows if r[2] != MATCH] == [] and len(rows) == 4


def test_the_custom_backward_is_the_one_used_not_autograds(registry):
    import torch
    x = torch.randn(8, 16).requires_grad_(True)
    STERound = registry.get("test_ste_round").fn.__self__  # noqa: N806 (the registered class)
    ClippedTanh = registry.get("test_clipped_tanh").fn.__self__  # noqa: N806
    STERound.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))  # straight through (round's own gradient is 0)
    x.grad = None
    y = ClippedTanh.apply(3 * x)
    y.sum().backward()
    assert torch.allclose(x.grad, 3 * (1 - y.detach() ** 2).clamp(min=0.5))


def test_an_unregistered_autograd_function_becomes_one_operator_with_its_own_backward():
    """Inlined, Sign's straight-through gradient would be dropped (sign's own is 0); it is kept as one
    operator with an inferred annotation, said in one warning at the model's line applying it."""
    import torch
    from nnscaler.trace.build import trace
    from nnscaler.ops.lint import AnnotationWarning

    class Sign(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return torch.sign(x)

        @staticmethod
        def backward(ctx, g):
            return g

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return Sign.apply(self.lin(x)).sum()

    with pytest.warns(AnnotationWarning, match=r"Sign: a torch.autograd.Function traced as one operator with its "
                                               r"own backward, annotation inferred by probing: 'a b -> a b'") as seen:
        graph = trace(Net(), (torch.randn(2, 4),))
    assert any(w.filename == __file__ for w in seen)  # at the model's line that applies it
    (op,) = [o for o in graph.ops if "Sign" in o.overload]
    assert op.spec.family == "inferred"


def test_a_custom_op_registered_without_a_name_goes_by_its_qualified_name(registry):
    spec = registry.get("nnscaler_test::twice")
    assert spec.aten == ("nnscaler_test.twice.default",)
    import subprocess
    import sys
    from pathlib import Path
    fixture = Path(__file__).parents[1] / "fixtures" / "custom_models.py"
    r = subprocess.run([sys.executable, "-m", "verify", "op", "nnscaler_test::twice", "--module", str(fixture),
                        "--world-size", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-1500:]
