"""The CLIP-style contrastive model (``clip_tiny``, ``verify/models/contrastive.py``): a loss that couples
the whole batch through the ``B x B`` similarity matrix scaled by a learned ``exp(logit_scale)``, whose
scalar gradient is a reduction over every pair. Every policy's plan trains like one device in float32
and float64, its checkpoint resumed included; and ``hybrid`` plans the loss over the square logits
(both mesh axes offered only the batch identifier, so the greedy planner had no partition at all)."""
from __future__ import annotations

import warnings

import pytest

from nnscaler.compile.plan import trace_model
from nnscaler.policies import POLICIES, ComputeConfig
from verify.models.registry import MODELS


def test_hybrid_plans_the_loss_over_square_logits():
    case = MODELS["clip_tiny"](0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace_model(case.model, case.batch(0), None, registry=None, strict=False)
        plan = POLICIES["hybrid"](graph, ComputeConfig(4, tp_size=2))
    losses = [op for op in graph.ops if op.overload == "aten.cross_entropy_loss.default"]
    assert len(losses) == 2 and all(op.name in plan.partitions for op in losses)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_clip_trains_like_one_device(verify_model, dtype):
    rows = verify_model("clip_tiny", policies=["dp", "tp", "random"], world_sizes=(2,), steps=2, dtype=dtype)
    assert len(rows) == 3


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_clip_trains_like_one_device_over_five_seeds(verify_model, dtype):
    rows = verify_model("clip_tiny", policies=["dp", "tp", "hybrid", "random", "random2d"], world_sizes=(2, 4),
                        seeds=range(5), dtype=dtype)
    assert len(rows) == 2 * 5 * 5  # world sizes x policies x seeds: every row judged (each a subtest)
