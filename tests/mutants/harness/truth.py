"""Harness mutants of what a row says and what it is judged on: a non-finite single-device reference
(``verify/judge/finite.py``), the step-0 note of localisation (``verify/localize/eager.py``), a user's file
imported once (``verify/user_files.py``), the reports directory's refusal of a run at other settings
(``verify/report/writer.py``), the widened-bound note (``verify/judge/compare.py``, ``verify/judge/verdict.py``)
and the one dtype conversion of the user's model (``verify/judge/dtypes.py``)."""
from __future__ import annotations

from ._base import _compare, _dtypes, _eager, _finite, _user_files, _verdict, _writer, mutant, patch, wrap

TRUTH = "tests/harness/test_verdict_truth.py"
ONCE = "tests/harness/test_imported_once.py"
REPORTS = "tests/harness/test_reports_dir.py"
DTYPES_TEST = "tests/harness/test_dtype_conversion.py"


@mutant("verify/judge/finite.py:require_finite",
        [f"{TRUTH}::test_a_model_whose_own_loss_is_nan_is_an_error_of_the_model_never_a_mismatch",
         f"{TRUTH}::test_any_non_finite_reference_value_names_the_step_the_tensor_and_the_model"])
def non_finite_reference_judged():
    """A NaN or infinite single-device loss or gradient is judged as a reference (a MISMATCH of the plan,
    or NaN matching NaN) instead of an error row naming the model itself."""
    patch(_finite(), "require_finite", lambda one, step, where="": one)


@mutant("verify/localize/eager.py:step_zero_check",
        [f"{TRUTH}::test_a_failing_step_zero_check_is_never_followed_by_every_tensor_of_step_zero_matches"])
def step_zero_note_contradicts_the_check():
    """No failing check counts as step 0's: the note says every tensor of step 0 matches next to a failing
    step-0 gradient or loss."""
    patch(_eager(), "step_zero_check", lambda check: False)


@mutant("verify/user_files.py:UserFiles.find_spec",
        [f"{ONCE}::test_a_module_file_the_model_also_imports_is_imported_once",
         f"{ONCE}::test_every_name_that_finds_the_file_gets_the_one_module"])
def user_file_imported_twice():
    """A plain ``import ops`` of a file already given by ``--module`` imports it again (its
    ``register_op`` calls run twice: "already registered")."""
    patch(_user_files().UserFiles, "find_spec", lambda self, fullname, path=None, target=None: None)


@mutant("verify/report/writer.py:ReportWriter._check_replace",
        [f"{REPORTS}::test_a_finished_run_at_other_settings_is_refused",
         f"{REPORTS}::test_a_finished_model_run_with_another_policy_or_steps_is_refused_before_any_rank"])
def other_settings_replaced():
    """A finished run at other settings (world sizes, policies, steps, recipe) in the reports directory is
    replaced as if it were this run's, its rows mixed with this run's."""
    writer = _writer()

    def make(orig):
        def _check_replace(self):
            try:
                orig(self)
            except writer.ReportError as exc:
                if "other settings" not in str(exc):
                    raise
        return _check_replace
    wrap(writer.ReportWriter, "_check_replace", make)


@mutant("verify/judge/compare.py:Float64Fallback.widened_note", [f"{DTYPES_TEST}::test_a_widened_bound_is_named_with_why"])
def widened_bound_silent():
    """A bound far over its dtype's rounding says nothing in the row."""
    patch(_compare().Float64Fallback, "widened_note", lambda self, checks: [])


@mutant("verify/judge/verdict.py:WIDENED", [f"{DTYPES_TEST}::test_a_widened_bound_is_named_with_why"])
def widened_note_left_out_of_the_row():
    """The widened-bound check stays among the checks but the MATCH row's detail never names it."""
    patch(_verdict(), "WIDENED", "note: (no such note)")


@mutant("verify/judge/compare.py:NARROW", [f"{DTYPES_TEST}::test_a_widened_bound_is_named_with_why"])
def narrow_reference_unnoticed():
    """A float64 reference holding narrower tensors (a complex64 buffer) goes unnamed."""
    patch(_compare(), "NARROW", ())


@mutant("verify/judge/dtypes.py:complex_of",
        [f"{DTYPES_TEST}::test_convert_changes_only_what_it_must",
         f"{DTYPES_TEST}::test_to_dtype_keeps_complex_buffers_complex"])
def complex_cast_to_real():
    """The runs' conversion casts complex tensors to the real dtype (``Module.to(float32)``: the imaginary
    part of a RoPE cache dropped), while the float64 reference keeps them."""
    patch(_dtypes(), "complex_of", lambda dtype: dtype)
