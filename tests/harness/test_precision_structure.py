"""The recipe's precision checked structurally (verify/cases/precision_record.py): a program narrower than
its ``bf16-mixed`` recipe fails its row by name, whatever its values. In process (one gloo rank): each kind
of place the record judges (a gradient bucket's all-reduce, a stage transfer, autocast's float32 operators,
the optimizer's weights, state and arithmetic, the loss). On ranks (W=2), one planted downgrade per kind
(tests/fixtures/precision_*.py) fails its row naming the place; the correct recipe matches on nanogpt and
llama under dp, tp and pp, and ``--grad-reduce-dtype bf16`` (which promises bf16) matches."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nnscaler.recipe import Recipe
from verify.cases.precision_record import PrecisionRecord, autocast_fp32_ops

from conftest import FIXTURES, MODULES

MIXED = Recipe(precision="bf16-mixed")


def _names(record: PrecisionRecord, pm=None, opt=None, **kw) -> list[str]:
    return [c.name for c in record.checks(pm, opt, **kw) if not c.ok]


def test_autocast_fp32_operators_are_learnt_on_this_device_and_plain_arithmetic_is_not_one():
    ops = autocast_fp32_ops("cpu")
    assert "aten.nll_loss_forward.default" in ops and "aten.mse_loss.default" in ops
    assert not ops & {"aten.mul.Tensor", "aten.mean.default", "aten.sum.default", "aten._log_softmax.default"}


def test_a_float32_recipe_records_nothing_and_adds_no_check():
    record = PrecisionRecord.of(Recipe())
    before = dist.all_reduce
    with record:
        assert dist.all_reduce is before
        F.cross_entropy(torch.randn(4, 8).bfloat16(), torch.zeros(4, dtype=torch.long))
    assert record.checks(None) == [] and record.watch(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))])).step


def test_a_gradient_bucket_reduced_in_bf16_is_named(one_rank):
    from nnscaler.runtime.grad_sync import GradSync
    for recipe, fails in ((MIXED, True), (Recipe(precision="bf16-mixed", grad_reduce_dtype="bf16"), False)):
        p = torch.nn.Parameter(torch.randn(4))
        sync = GradSync.build([(p, dist.group.WORLD)], reduce_dtype=torch.bfloat16)
        sync.attach()
        record = PrecisionRecord.of(recipe)
        with record:
            (p * 2).sum().backward()
            sync.finish()
        bad = _names(record)
        assert bad == (["precision: gradient all-reduce of bucket 0 in bfloat16, the recipe promises float32"]
                       if fails else []), bad
    record = PrecisionRecord.of(MIXED)
    with record:  # an fp32 reduction keeps the promise
        dist.all_reduce(torch.ones(2))
    assert _names(record) == []


class _Stages:
    """A pipeline as the record sees it: its stage boundaries' traced dtypes."""

    def boundary_dtypes(self):
        return {torch.float32}


def test_a_stage_transfer_in_bf16_where_the_trace_says_fp32_is_named(one_rank):
    record = PrecisionRecord.of(MIXED)
    with record:
        dist.P2POp(dist.isend, torch.ones(2, dtype=torch.bfloat16), 0)
    assert _names(record, _Stages()) == ["precision: pipeline stage transfer (send) in bfloat16, the recipe "
                                         "promises the traced float32"]
    record = PrecisionRecord.of(MIXED)
    with record:
        dist.P2POp(dist.irecv, torch.ones(2), 0)
    assert _names(record, _Stages()) == []


def test_ring_attentions_own_exchange_in_bf16_is_not_taken_for_a_stage_transfer(one_rank):
    """Ring attention rotates keys and values with P2P ops of its own (``nnscaler/runtime/ring.py``), in the compute
    dtype: under a pipeline they are not stage boundaries (a ring x pp plan was a false MISMATCH); a P2P op from
    anywhere else still is."""
    from nnscaler.runtime import ring
    where = {"dist": dist, "torch": torch}
    exec(compile("def post(t):\n    return dist.P2POp(dist.isend, t, 0)\n", ring.__file__, "exec"), where)
    record = PrecisionRecord.of(MIXED)
    with record:
        where["post"](torch.ones(2, dtype=torch.bfloat16))
    assert _names(record, _Stages()) == [] and any(p[0].startswith("ring exchange") for p in record.places)
    with record:
        dist.P2POp(dist.isend, torch.ones(2, dtype=torch.bfloat16), 0)
    assert _names(record, _Stages()) == ["precision: pipeline stage transfer (send) in bfloat16, the recipe "
                                         "promises the traced float32"]


def test_autocast_fp32_operator_run_in_bf16_and_a_narrower_loss_are_named():
    record = PrecisionRecord.of(MIXED)
    target = torch.zeros(4, dtype=torch.long)
    with record:
        F.cross_entropy(torch.randn(4, 8), target)  # as the program runs it: inputs cast to fp32
    assert _names(record) == []
    with record:
        loss = F.cross_entropy(torch.randn(4, 8).bfloat16(), target)
    bad = _names(record, loss=loss, reference_loss=torch.tensor(1.0))
    assert bad == ["precision: aten.nll_loss_forward.default (autocast's float32 operator) in bfloat16, the recipe "
                   "promises float32",
                   "precision: the loss in bfloat16, the recipe promises float32 (the single-device run's)"], bad


def test_bf16_master_weights_state_and_optimizer_math_are_named():
    record = PrecisionRecord.of(MIXED)
    good = torch.nn.Parameter(torch.randn(3))
    good.grad = torch.ones(3)
    opt = record.watch(torch.optim.AdamW([good]))
    opt.step()
    assert _names(record, opt=opt) == []
    low = torch.nn.Parameter(torch.randn(3).bfloat16())
    low.grad = torch.ones(3).bfloat16()
    opt = record.watch(torch.optim.AdamW([low]))
    opt.step()
    bad = _names(record, opt=opt)
    assert bad[0].startswith("precision: optimizer math: aten.") and "in bfloat16" in bad[0], bad
    assert bad[1:] == ["precision: master weights (the optimizer's parameters) in bfloat16, the recipe promises float32",
                       "precision: optimizer state exp_avg in bfloat16, the recipe promises float32"], bad


# -- on ranks -------------------------------------------------------------------------------------------------
def _row(gang, model, policy, **cfg):
    from verify.config import RunConfig
    from verify.rows.run import run_model
    cfg = RunConfig(world_sizes=(2,), modules=gang.modules, precision="bf16-mixed", **cfg)
    with tempfile.TemporaryDirectory() as tmp:
        (row,) = run_model(gang, model, (policy,), cfg, tmp, steps=1, checkpoint=False)
    return row


@pytest.mark.parametrize("plant, policy, cfg, says", [
    ("precision_grad_bf16", "dp", {}, "precision: gradient all-reduce of bucket 0 in bfloat16, the recipe promises float32"),
    ("precision_zero_bf16", "dp", {"zero": 2}, "precision: ZeRO gradient reduce-scatter of bucket 0 in bfloat16, "
                                               "the recipe promises float32"),
    ("precision_stage_bf16", "pp", {}, "precision: pipeline stage transfer (send) in bfloat16, the recipe promises "
                                       "the traced float32"),
    ("precision_optimizer_bf16", "dp", {}, "precision: optimizer math: aten."),
    ("precision_autocast_bf16", "dp", {}, "precision: cross_entropy_loss (aten.cross_entropy_loss.default, autocast's "
                                          "float32 operator) cast to nothing, the recipe promises float32"),
])
def test_a_planted_downgrade_fails_its_row_by_name(plant, policy, cfg, says):
    from verify.judge.verdict import MISMATCH
    from verify.runner.gang import Gang
    with Gang(2, (*MODULES, str(FIXTURES / f"{plant}.py")), (2,)) as bad:
        row = _row(bad, "nanogpt", policy, **cfg)
    assert row.status == MISMATCH and row.detail.startswith(says), (row.status, row.detail)


@pytest.mark.parametrize("model, policy, cfg", [("llama", "dp", {}), ("llama", "tp", {}), ("llama", "pp", {}),
                                                ("nanogpt", "dp", {"grad_reduce_dtype": "bf16"}),
                                                ("nanogpt", "dp", {"zero": 2})])
def test_the_correct_recipe_keeps_its_promises(gang, model, policy, cfg):
    """nanogpt under dp, tp and pp: tests/harness/test_precision_harness.py (the same rows carry the check)."""
    from verify.judge.verdict import MATCH
    row = _row(gang, model, policy, **cfg)
    assert row.status == MATCH, (row.status, row.detail)


def test_an_autocast_fp32_operator_the_program_does_not_cast_is_named():
    """The program's own operators against autocast learnt afresh from the trace: cross-entropy left uncast
    (a vocabulary-parallel kernel then computes it in bf16 elementwise operators) is named."""
    from types import SimpleNamespace
    from nnscaler.compile.plan import trace_model
    from nnscaler.compile.precision import apply_precision
    from verify.cases.precision_record import uncast_fp32_operators

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 5)

        def forward(self, x, t):
            return F.cross_entropy(self.lin(x), t)

    graph = trace_model(Head(), (torch.randn(4, 8), torch.arange(4)), None, registry=None, strict=False)
    apply_precision(graph, "bf16-mixed")
    pm = SimpleNamespace(graph=graph)
    assert uncast_fp32_operators(pm) == []
    (ce,) = [op for op in graph.ops if op.overload == "aten.cross_entropy_loss.default"]
    ce.cast = None
    assert uncast_fp32_operators(pm) == [(f"{ce.name} (aten.cross_entropy_loss.default, autocast's float32 "
                                          f"operator) cast to nothing", "float32")]


def test_a_replicas_row_is_judged_too():
    """``--replicas``: the replicas' averaging buckets reduced in bf16 fail the row by name."""
    from verify.config import RunConfig
    from verify.judge.verdict import MISMATCH
    from verify.rows.replicas import run_replicas
    from verify.runner.gang import Gang
    mods = (*MODULES, str(FIXTURES / "precision_grad_bf16.py"))
    with Gang(2, mods, (2,)) as bad, tempfile.TemporaryDirectory() as tmp:
        cfg = RunConfig(world_sizes=(2,), modules=mods, precision="bf16-mixed")
        (row,) = run_replicas(bad, "nanogpt", ("tp",), cfg, tmp, 2, steps=1)
    assert row.status == MISMATCH and row.detail.startswith(
        "precision: gradient all-reduce of bucket 0 in bfloat16, the recipe promises float32"), row.detail
