"""Harness mutants of users' pipelines (``verify/cases/torchpar/pipeline.py``): the stage layout check, the
step's loss as the schedule defines it (mean or sum of micro-batch losses), tensors read from the stage that
holds them, and the ``pp`` mesh dimension required before ranks start."""
from __future__ import annotations

from ._base import _torchpar_pipeline, mutant, patch

TESTS = "tests/harness/test_torchpar_pipeline.py"


@mutant("verify/cases/torchpar/pipeline.py:layout_check",
        [f"{TESTS}::test_stages_out_of_order_are_named", f"{TESTS}::test_a_stage_that_drops_a_layer_is_named"])
def pipeline_layout_unchecked():
    """The stage layout always passes: a dropped layer or stages out of order are left to the numbers, unnamed."""
    P = _torchpar_pipeline()
    patch(P, "layout_check", lambda held, order, prefix: P.Check("stage layout", 0.0, 0.0, True, ""))


@mutant("verify/cases/torchpar/pipeline.py:micro_batch_mean",
        f"{TESTS}::test_a_loss_not_averaged_over_micro_batches_is_caught")
def pipeline_loss_always_a_mean():
    """The step's loss is the mean of the micro-batch losses even where the schedule sums their gradients."""
    patch(_torchpar_pipeline(), "micro_batch_mean", lambda schedule: True)


@mutant("verify/cases/torchpar/pipeline.py:RankStages._across",
        f"{TESTS}::test_pipelines_match_one_device")
def pipeline_tensors_of_this_rank_only():
    """Gradients and parameters are those of this rank's stages only: the other stages' are never compared."""
    patch(_torchpar_pipeline().RankStages, "_across", lambda self, local: local)


@mutant("verify/cases/torchpar/pipeline.py:check_pipeline",
        f"{TESTS}::test_bad_pipeline_input_is_one_line_exit_2_before_ranks_start")
def pipeline_mesh_without_pp_accepted():
    """A pipeline on a mesh without ``pp`` goes to the ranks unchecked."""
    patch(_torchpar_pipeline(), "check_pipeline", lambda pipe, mesh_names, model_names, fn_name: None)


@mutant("verify/cases/torchpar/pipeline.py:loss_scale",
        f"{TESTS}::test_fsdp_division_disabled_as_torchtitan_ships_it_matches")
def pipeline_undivided_loss_averaged():
    """With FSDP's division disabled, the step's loss is still averaged over dp (a right program is failed)."""
    patch(_torchpar_pipeline(), "loss_scale", lambda module, degree: (1.0, ""))
