"""Harness mutants of what a case measures: the tie-flip samples of the bf16 spread
(``verify/cases/spread.py``), the equal random draws of a step and the rows that must stay unverifiable
(``verify/cases/draws.py``, ``verify/judge/verdict.py``), the torch-parallelization path's batch slicing
(``verify/cases/torchpar/mesh.py``, torchtitan's data dimensions there, meshes a program lays itself
``gang_mesh.py``, a resume through state-dict hooks ``case.py``, wrapper prefixes in its names ``names.py``, FSDP2 on gloo ``fsdp.py``, users'
context parallelism on CPU ``ring_cpu.py``: its note, the loss over cp, torch's CP options restored), an
error that keeps its checks (``verify/judge/verdict.py:RaisedAfter``), the blocked layouts' backward
(``nnscaler/runtime/collectives.py``) and the buffers compared after every step (``verify/cases/buffers.py``)."""
from __future__ import annotations

import contextlib

from ._base import (_buffers, _collectives, _draws, _replicas_case, _spread, _torchpar, _torchpar_mesh, _training, _verdict,
                    mutant, patch)

RULES = "tests/harness/test_harness_rules.py"


@mutant("verify/cases/spread.py:TIE_FACTOR", [f"{RULES}::test_a_clear_winner_is_never_flipped_as_a_tie"])
def every_selection_a_tie():
    """Every discrete selection counts as a near-tie and is flipped: the spread sample absorbs a wrong routing."""
    patch(_spread(), "TIE_FACTOR", 1e12)


@mutant("verify/cases/torchpar/mesh.py:dp_slice", ["tests/harness/test_torchpar.py::test_a_plan_that_forgets_to_average_over_dp_is_caught"])
def torchpar_batch_not_sliced():
    """Every dp rank of a torch parallelization gets the whole batch: a plan that never syncs gradients matches."""
    patch(_torchpar_mesh(), "dp_slice", lambda args, mesh: args)


@mutant("nnscaler/runtime/collectives.py:_AllGatherSumGrad.backward",
        ["tests/compiler/test_blocked_backward.py::test_a_blocked_gather_whose_gradient_is_summed_scatters_by_blocks"])
def blocked_sum_grad_backward_unblocked():
    """An all-gather whose gradient is summed reduce-scatters its gradient without the layout's blocks."""
    C = _collectives()
    patch(C._AllGatherSumGrad, "backward", staticmethod(
        lambda ctx, g: (C._reduce_scatter(g, ctx.dim, ctx.group, 1), None, None, None)))


@mutant("nnscaler/runtime/collectives.py:_AllGather.backward",
        ["tests/compiler/test_blocked_backward.py::test_a_blocked_gather_and_split_pass_gradients_back_by_blocks"])
def blocked_gather_backward_unblocked():
    """A blocked all-gather's backward keeps the rank's plain chunk of the gradient, not its blocks."""
    C = _collectives()
    patch(C._AllGather, "backward", staticmethod(lambda ctx, g: (C._chunk(g, ctx.dim, ctx.group, 1), None, None, None)))


@mutant("nnscaler/runtime/collectives.py:_Split.backward",
        ["tests/compiler/test_blocked_backward.py::test_a_blocked_gather_and_split_pass_gradients_back_by_blocks"])
def blocked_split_backward_unblocked():
    """A blocked split's backward gathers the gradient as plain chunks."""
    C = _collectives()
    patch(C._Split, "backward", staticmethod(lambda ctx, g: (C._gather(g, ctx.dim, ctx.group, 1), None, None, None)))


# -- random draws: equal in the run and its references, or the row unverifiable (the draws branch's tests too)
@mutant("verify/cases/draws.py:same_draws",
        ["tests/harness/test_draws_in_process.py::test_a_correct_plan_of_a_model_that_draws_matches"], owner="draws")
def draws_not_replayed():
    """Each forward of a step draws on from the running generator: the run and its references draw other numbers."""
    patch(_draws(), "same_draws", lambda seed, step: contextlib.nullcontext())


@mutant("verify/judge/draw_record.py:DrawRecord.replaying",
        ["tests/harness/test_draws_in_process.py::"
         "test_a_draw_split_per_shard_is_caught_at_the_operator_and_the_right_kernel_is_bound_at_rounding"])
def op_reference_draws_in_float64():
    """An operator case's float64 reference draws its own float64 numbers: the bound grows to the size of the
    draws, and a kernel that draws only its shard's numbers matches."""
    from verify.judge import draw_record
    patch(draw_record.DrawRecord, "replaying", lambda self: contextlib.nullcontext())


@mutant("verify/judge/verdict.py:check_deterministic",
        ["tests/harness/test_draws_in_process.py::test_micro_batches_leave_a_model_that_draws_unverifiable"],
        owner="draws")
def drawing_model_judged_in_pieces():
    """A model that draws is judged under micro-batches, where each piece draws its own mask."""
    patch(_verdict(), "check_deterministic", lambda graph, why: None)


@mutant("verify/judge/verdict.py:RaisedAfter", ["tests/harness/test_torchpar.py::test_a_resume_that_raises_keeps_the_training_checks"])
def raised_after_drops_checks():
    """A case that raises after its training checks loses them: the row holds only the error."""
    cls = _verdict().RaisedAfter
    orig = cls.__init__

    def __init__(self, checks, cause, where):
        orig(self, [], cause, where)
    patch(cls, "__init__", __init__)


@mutant("verify/cases/torchpar/case.py:CheckpointException",
        ["tests/harness/test_torchpar.py::test_a_resume_that_raises_keeps_the_training_checks[dcp]"])
def dcp_error_drops_checks():
    """A resume that raises torch.distributed.checkpoint's error (a BaseException) is not caught as the resume's:
    the row loses the training checks made before it."""
    patch(_torchpar(), "CheckpointException", type("NeverRaised", (Exception,), {}))


@mutant("verify/rows/torchpar.py:localize_error",
        ["tests/harness/test_torchpar.py::test_a_program_that_raises_names_where_it_first_parted"])
def raising_program_not_localized():
    """A torch program that raises is an error row naming only where it raised, never where it first went wrong."""
    from verify.rows import torchpar
    patch(torchpar, "localize_error", lambda gang, job, cfg: "")


@mutant("verify/rows/torchpar.py:BUILD_RAISED",
        ["tests/harness/test_torchpar.py::test_a_program_that_raises_while_it_is_built_is_not_localised"])
def build_error_localized():
    """A program whose fn(model, mesh) raised on the ranks is rerun by the localiser, which has no step to judge."""
    from verify.rows import torchpar
    patch(torchpar, "BUILD_RAISED", "\0never in a row\0")


@mutant("verify/cases/torchpar/localize.py:Recorder._late",
        ["tests/harness/test_torchpar.py::test_a_program_that_raises_names_where_it_first_parted[mislaid]"])
def style_output_unread():
    """The localiser judges a module's output before its style's hook relabels it: an output declared with
    the wrong global shape looks right, and the module it surfaces in is blamed."""
    from verify.cases.torchpar import localize

    def _late(self, mod, args, out):
        call = self.calls[self.pending[mod][-1]]
        late = localize._tensors(out)
        if len(late) == len(call["outputs"]):
            call["outputs"] = [localize._keep(t) if o is None else o for o, t in zip(call["outputs"], late)]
    patch(localize.Recorder, "_late", _late)


@mutant("verify/cases/torchpar/case.py:load_whole",
        ["tests/harness/test_torchpar.py::test_strided_shards_are_loaded_piece_by_piece"])
def strided_shard_loaded_as_a_block():
    """The reference point is loaded into a strided shard as one block at its offset: a right MoE plan mismatches."""
    torchpar = _torchpar()

    def load_whole(module, state):
        with torchpar.torch.no_grad():
            for n, p in torchpar.named_parameters(module):
                if isinstance(p, torchpar.DTensor):
                    shape, offset = torchpar.compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                    p.to_local().copy_(state[n][tuple(slice(o, o + s) for o, s in zip(offset, shape))])
                else:
                    p.copy_(state[n])
    patch(torchpar, "load_whole", load_whole)


@mutant("verify/cases/torchpar/names.py:model_name",
        ["tests/harness/test_torchpar.py::test_activation_checkpointing_as_torchtitan_applies_it_verifies"])
def wrapper_prefixes_kept():
    """Parameter names keep ``checkpoint_wrapper``'s prefix: activation checkpointing as torchtitan applies it is refused."""
    from verify.cases.torchpar import names
    patch(names, "model_name", lambda name: name)


def _fsdp():
    from verify.cases.torchpar import fsdp
    return fsdp


@mutant("verify/cases/torchpar/fsdp.py:loss_scale",
        ["tests/harness/test_torchpar.py::test_fsdp_gradients_divided_twice_are_caught"])
def fsdp_any_divide_factor_compensated():
    """Whatever FSDP2's gradient divide factor, the loss is scaled to compensate it: a program dividing wrongly matches."""
    def loss_scale(module, degree):
        found = {(g.gradient_divide_factor, _fsdp()._dp_size(g)) for g in _fsdp()._groups(module)
                 if g.gradient_divide_factor is not None}
        if not found:
            return 1.0, ""
        factor, dp = next(iter(found))
        return factor / dp, ""
    patch(_fsdp(), "loss_scale", loss_scale)


@mutant("verify/cases/torchpar/fsdp.py:loss_scale",
        ["tests/harness/test_torchpar.py::test_fsdp_as_torchtitan_ships_it_verifies_on_gloo"])
def fsdp_undivided_loss_unscaled():
    """A program with FSDP's gradient division disabled is trained with an unscaled loss: a right program fails."""
    patch(_fsdp(), "loss_scale", lambda module, degree: (1.0, ""))


@mutant("verify/cases/buffers.py:buffer_names",
        ["tests/compiler/test_buffer_writes.py::test_a_program_that_drops_or_does_not_reduce_a_buffer_write_is_caught",
         "tests/harness/test_verdict_truth.py::test_a_buffer_written_in_forward_matches_and_a_program_that_drops_the_write_is_named"])
def buffers_not_compared():
    """No buffer is compared after a step (parameters only, as before issue 41): a program that never writes
    back a buffer its forward updates, or writes each rank's unreduced share of a batch statistic, matches."""
    patch(_buffers(), "buffer_names", lambda model: [])


WRITES = "tests/compiler/test_buffer_writes.py"


@mutant("verify/cases/training.py:ReplicaShare.compiled",
        [f"{WRITES}::test_models_writing_batch_statistics_train_equal_to_one_device_as_data_parallel_replicas"])
def replica_reference_per_share_for_writes():
    """One device runs each replica's share for a model whose forward writes a buffer: its forward runs once per
    share (the EMA updated twice a step), so a right program with statistics over every replica's rows fails."""
    patch(_training().ReplicaShare, "compiled", lambda self, pm: self)


@mutant("verify/cases/replicas.py:reference_buffers",
        [f"{WRITES}::test_a_replica_writing_a_statistic_of_its_own_rows_is_caught"])
def replica_buffers_not_compared():
    """Replicas cases compare parameters only (their reference gives no buffers): a replica writing the mean of
    its own rows into a buffer forward never reads back matches."""
    patch(_replicas_case(), "reference_buffers", lambda ref, ref64, before: {})


CP = "tests/harness/test_torchpar_cp.py"


@mutant("verify/cases/torchpar/ring_cpu.py:Substituted.note",
        [f"{CP}::test_causal_ring_attention_matches_one_device"])
def cp_cpu_attention_not_said():
    """A user's ring attention runs through the CPU kernel and the row does not say so (nor its rotate method)."""
    from verify.cases.torchpar import ring_cpu
    patch(ring_cpu.Substituted, "note", lambda self: "")


@mutant("verify/cases/torchpar/mesh.py:loss_axes",
        [f"{CP}::test_titan_llama_with_fsdp_over_cp_matches_one_device"])
def cp_loss_not_averaged():
    """The step's loss under cp is rank 0's own chunks' loss, not the mean over cp: a right program fails."""
    from verify.cases.torchpar.mesh import DP
    patch(_torchpar_mesh(), "loss_axes", lambda mesh: [n for n in (mesh.mesh_dim_names or ()) if n == DP])


@mutant("verify/cases/torchpar/ring_cpu.py:cpu_ring_attention",
        [f"{CP}::test_float64_ring_merging_in_float32_is_caught_and_torch_options_are_restored"])
def cp_options_leak_between_cases():
    """torch's CP options a user's fn set (rotate method, float32 merge) stay set for the gang's next case."""
    from verify.cases.torchpar import ring_cpu
    orig = ring_cpu.cpu_ring_attention

    @contextlib.contextmanager
    def leaky():
        from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options
        with orig() as used:
            yield used
            kept = dict(_cp_options.__dict__)
        _cp_options.__dict__.update(kept)
    patch(ring_cpu, "cpu_ring_attention", leaky)


@mutant("verify/cases/torchpar/ring_cpu.py:merges_in_float32",
        [f"{CP}::test_float64_ring_merging_in_float32_is_caught_and_torch_options_are_restored"])
def cp_float32_merge_not_said():
    """A float64 row of torch's ring attention fails without saying that torch merges its blocks in float32."""
    from verify.cases.torchpar import ring_cpu
    patch(ring_cpu, "merges_in_float32", lambda: False)


@mutant("verify/runner/rank_logs.py:RankLogs.last_words",
        ["tests/harness/test_culprits.py::test_a_collective_mismatch_that_aborts_a_rank_is_named_with_its_module"])
def dying_words_unread():
    """A rank that dies is only "died (exit code -6)": gloo's collective-mismatch diagnosis stays on stderr."""
    from verify.runner import rank_logs
    patch(rank_logs.RankLogs, "last_words", lambda self, rank: "")


@mutant("verify/cases/torchpar/localize.py:ModuleStack._say",
        ["tests/harness/test_culprits.py::test_a_collective_mismatch_that_aborts_a_rank_is_named_with_its_module"])
def breadcrumb_unwritten():
    """A rank that dies inside a module leaves no breadcrumb: the row cannot say which module issued the collective."""
    from verify.cases.torchpar import localize
    patch(localize.ModuleStack, "_say", lambda self: None)


@mutant("verify/cases/torchpar/localize.py:_per_rank_normalisation",
        ["tests/harness/test_culprits.py::test_a_loss_normalised_per_rank_is_named_not_the_gradient_sync"])
def per_rank_loss_unnamed():
    """A loss normalised per rank is blamed on what follows backward (the gradient sync), not on the loss."""
    from verify.cases.torchpar import localize
    patch(localize, "_per_rank_normalisation", lambda ref64, args, mesh, first_failure: None)


@mutant("verify/cases/torchpar/localize.py:_per_rank_normalisation",
        ["tests/harness/test_torchpar.py::test_a_plan_that_forgets_to_average_over_dp_is_caught"])
def every_loss_fault_per_rank():
    """Every fault under dp that no module explains is called a per-rank normalisation of the loss, a missing
    gradient sync among them."""
    from verify.cases.torchpar import localize
    patch(localize, "_per_rank_normalisation", lambda ref64, args, mesh, first_failure: "the loss is normalised per rank")


@mutant("verify/cases/torchpar/localize.py:_with_operator",
        ["tests/harness/test_culprits.py::test_inside_the_module_the_first_divergent_operator_is_named",
         "tests/harness/test_culprits.py::test_an_operator_only_the_parallel_program_runs_in_backward_is_named"])
def operators_inside_unnamed():
    """A torch program's row stops at the module: the operator inside it is never named."""
    from verify.cases.torchpar import localize
    patch(localize, "_with_operator", lambda found, *a: found)


@mutant("verify/cases/torchpar/op_log.py:_views",
        ["tests/harness/test_culprits.py::test_inside_the_module_the_first_divergent_operator_is_named"])
def views_blamed():
    """Views are logged and paired like computing operators: a view of an already wrong value is named first."""
    from verify.cases.torchpar import op_log
    patch(op_log, "_views", lambda func: False)


def _torchpar_case_and_localiser():
    from verify.cases.torchpar import localize
    return _torchpar(), localize


@mutant("verify/cases/torchpar/mesh.py:DATA",
        ["tests/harness/test_torchpar_meshes.py::test_a_plan_that_forgets_to_average_over_dp_replicate_x_dp_shard_is_caught"])
def torchpar_hsdp_dims_not_sliced():
    """Only a dimension named ``dp`` splits the batch: torchtitan's dp_replicate x dp_shard ranks each get all of it,
    and a program that never synchronises its gradients there matches."""
    patch(_torchpar_mesh(), "DATA", ("dp",))


@mutant("verify/cases/torchpar/gang_mesh.py:gang_groups",
        ["tests/harness/test_torchpar_meshes.py::test_a_mesh_the_program_lays_itself_takes_the_gangs_groups"])
def torchpar_own_meshes_make_their_groups():
    """Meshes a program lays itself (torchtitan's ParallelDims) call torch's new_group on the case's ranks only."""
    from verify.cases.torchpar.gang_mesh import cpu_meshes
    for module in _torchpar_case_and_localiser():
        patch(module, "gang_groups", lambda groups: cpu_meshes())


@mutant("verify/cases/torchpar/names.py:model_state_dict",
        ["tests/harness/test_torchpar_meshes.py::test_state_dict_hooks_resume_through_the_models_own_state_dict"])
def torchpar_state_dict_hooks_unread():
    """The resume saves only through get_model_state_dict: a model whose state-dict hooks rename keys cannot resume."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from verify.cases.torchpar import names
    patch(names, "model_state_dict", lambda module: (get_model_state_dict(module), None))
