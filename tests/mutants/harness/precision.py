"""Harness mutants of the recipe's precision checked structurally (``verify/cases/precision_record.py``):
each lets a program narrower than its ``bf16-mixed`` recipe pass; each is killed by the in-process tests
of tests/harness/test_precision_structure.py (the planted downgrades on ranks kill them too)."""
from __future__ import annotations

import torch

from ._base import _precision_record, mutant, patch

TESTS = "tests/harness/test_precision_structure.py"


@mutant("verify/cases/precision_record.py:PrecisionRecord.reduce_dtype",
        [f"{TESTS}::test_a_gradient_bucket_reduced_in_bf16_is_named"])
def precision_reduce_promise_bf16():
    """Gradients are taken as promised in bf16 whatever the recipe says: a bf16 gradient all-reduce passes."""
    patch(_precision_record().PrecisionRecord, "reduce_dtype", property(lambda self: torch.bfloat16))


@mutant("verify/cases/precision_record.py:stage_dtypes",
        [f"{TESTS}::test_a_stage_transfer_in_bf16_where_the_trace_says_fp32_is_named"])
def precision_transfers_unjudged():
    """No traced dtype is known for a stage boundary: a pipeline's transfers are never judged."""
    patch(_precision_record(), "stage_dtypes", lambda pm: set())


@mutant("verify/cases/precision_record.py:autocast_fp32_ops",
        [f"{TESTS}::test_autocast_fp32_operators_are_learnt_on_this_device_and_plain_arithmetic_is_not_one",
         f"{TESTS}::test_autocast_fp32_operator_run_in_bf16_and_a_narrower_loss_are_named"])
def precision_no_autocast_fp32_ops():
    """No operator is known as autocast's float32 one: cross-entropy computed in bf16 passes."""
    patch(_precision_record(), "autocast_fp32_ops", lambda device_type="cpu": frozenset())


@mutant("verify/cases/precision_record.py:PrecisionRecord.watch",
        [f"{TESTS}::test_bf16_master_weights_state_and_optimizer_math_are_named"])
def precision_optimizer_unwatched():
    """The optimizer's step is not recorded: optimizer arithmetic in bf16 passes."""
    patch(_precision_record().PrecisionRecord, "watch", lambda self, opt: opt)


@mutant("verify/cases/precision_record.py:_optimizer_dtypes",
        [f"{TESTS}::test_bf16_master_weights_state_and_optimizer_math_are_named"])
def precision_optimizer_state_unjudged():
    """The optimizer's parameters and state are not looked at: bf16 master weights and moments pass."""
    patch(_precision_record(), "_optimizer_dtypes", lambda opt: [])


@mutant("verify/cases/precision_record.py:PrecisionRecord.active",
        [f"{TESTS}::test_a_gradient_bucket_reduced_in_bf16_is_named"])
def precision_never_recorded():
    """No recipe is recorded: every precision downgrade passes (the rows carry no precision check)."""
    patch(_precision_record().PrecisionRecord, "active", property(lambda self: False))


@mutant("verify/cases/precision_record.py:uncast_fp32_operators",
        [f"{TESTS}::test_an_autocast_fp32_operator_the_program_does_not_cast_is_named"])
def precision_program_casts_unjudged():
    """The program's operators are not compared with autocast: a cross-entropy computed in bf16 by the
    vocabulary-parallel kernel passes."""
    patch(_precision_record(), "uncast_fp32_operators", lambda pm, device_type="cpu": [])
