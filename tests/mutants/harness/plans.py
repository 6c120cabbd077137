"""Harness mutants of the reduced plan ``verify plan`` checks (``verify/models/saved_plan.py``): each field of a
saved plan must survive the reduction (axes, degrees, schedule, virtual stages, ZeRO stage, recompute,
sequence parallelism, context parallelism, precision), or the reduced run verifies another program than the one
planned; a plan with an axis the compiler cannot lower yet (cp) is refused by name (``verify/plan/cli.py``)."""
from __future__ import annotations

import dataclasses

from ._base import _plan_cli, _reduced, mutant, patch, wrap

RULES = "tests/harness/test_harness_rules.py"
REDUCED = "verify/models/saved_plan.py"
KEPT = f"{RULES}::test_the_reduced_plan_keeps_every_field_of_the_saved_one"


def _replace(name: str, doc: str, **change):
    def apply():
        wrap(_reduced(), "reduce_parallel", lambda orig: lambda par, as_planned=False: dataclasses.replace(
            orig(par, as_planned), **{k: (v(orig(par, as_planned)) if callable(v) else v) for k, v in change.items()}))
    apply.__name__, apply.__doc__ = name, doc
    mutant(f"{REDUCED}:reduce_parallel", [KEPT])(apply)


_replace("reduced_drops_zero", "The reduced plan caps the ZeRO stage at 0 (the issue's example).", zero=0)
_replace("reduced_zero_capped_at_1", "The reduced plan caps the ZeRO stage at 1.", zero=lambda p: min(p.zero, 1))
_replace("reduced_drops_virtual_stages", "The reduced plan runs 1F1B where the saved one interleaves virtual stages.",
         virtual_stages=1)
_replace("reduced_drops_sequence_parallel", "The reduced plan leaves sequence parallelism off.", sequence_parallel=False)
_replace("reduced_drops_recompute", "The reduced plan recomputes nothing.", recompute="none")
_replace("reduced_drops_tp_axis", "The reduced plan drops the tensor-parallel axis.", tp=1)
_replace("reduced_drops_pp_axis", "The reduced plan drops the pipeline axis.", pp=1)
_replace("reduced_drops_dp_axis", "The reduced plan drops the data-parallel axis.", dp=1)
_replace("reduced_drops_cp_axis", "The reduced plan drops the context-parallel axis.", cp=1)
_replace("reduced_drops_cp_scheme", "The reduced plan exchanges keys and values by the other scheme.",
         cp_scheme=lambda p: "allgather" if p.cp_scheme == "ring" else "ring")
_replace("reduced_drops_cp_balance", "The reduced plan's cp chunks ignore the causal balance.", cp_balanced=True)
_replace("reduced_single_microbatch", "The reduced plan runs one micro-batch where the saved one runs several.",
         num_microbatches=1)


@mutant(f"{REDUCED}:reduce", [f"{RULES}::test_the_reduced_plan_keeps_the_precision_and_a_batch_every_rank_divides"])
def reduced_drops_precision():
    """The reduced plan runs in float32 where the saved one trains in bf16-mixed."""
    wrap(_reduced(), "reduce", lambda orig: lambda saved, as_planned=False: {**orig(saved, as_planned), "precision": "32-true"})


@mutant(f"{REDUCED}:reduce_parallel", [f"{RULES}::test_the_reduced_plan_keeps_the_precision_and_a_batch_every_rank_divides"])
def reduced_batch_not_divisible():
    """The reduced plan's micro-batch is 1 whatever the data-parallel degree (the batch no longer divides)."""
    wrap(_reduced(), "reduce_parallel", lambda orig: lambda par, as_planned=False: dataclasses.replace(
        orig(par, as_planned), micro_batch_size=1))


@mutant("verify/plan/cli.py:refuse_unlowered",
        ["tests/compiler/test_plan_cluster.py::test_a_ulysses_plan_under_tp_lowers_and_a_scheme_the_compiler_lacks_is_refused_by_name"])
def verify_plan_takes_a_cp_plan():
    """``verify plan`` no longer refuses a context-parallel plan of a scheme the compiler lacks up front (it reaches the reduction and the
    lowering, whose message names neither the file nor the planned degree)."""
    patch(_plan_cli(), "refuse_unlowered", lambda saved: None)


@mutant(f"{REDUCED}:REDUCED_WORLD", [KEPT])
def reduced_world_uncapped():
    """A reduced plan takes 2 ranks per axis whatever their number: four axes ask for 16 ranks, more than run here."""
    patch(_reduced(), "REDUCED_WORLD", 10 ** 6)


@mutant(f"{REDUCED}:REDUCED_VIRTUAL", [KEPT])
def reduced_virtual_uncapped():
    """A reduced plan keeps every virtual stage (the 405B plans' 8 ran out of memory here)."""
    patch(_reduced(), "REDUCED_VIRTUAL", 10 ** 6)
