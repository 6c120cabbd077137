"""Harness mutants of the judge: the comparison rules and bounds (``verify/judge/compare.py``), the verdict
on a row (``verify/judge/verdict.py``), the bit-for-bit load check of a resume (``verify/cases/resume.py``)
and the choice of the tensor localisation names (``verify/localize/tensor_trace.py``)."""
from __future__ import annotations

import torch

from ._base import _compare, _resume, _tensor_trace, _verdict, mutant, patch, wrap

RULES = "tests/harness/test_harness_rules.py"
COMPARE = "verify/judge/compare.py"


def _passing(name_test):
    """A ``check_tensor`` that passes every tensor whose check name satisfies ``name_test``."""
    def make(orig):
        def check_tensor(name, par, dev, ref, *a, **kw):
            c = orig(name, par, dev, ref, *a, **kw)
            return c if c.ok or not name_test(name) else _compare().Check(name, c.err, max(c.tol, c.err), True)
        return check_tensor
    return make


@mutant(f"{COMPARE}:check_tensor", [f"{RULES}::test_a_wrong_loss_fails"])
def loss_unchecked():
    """The loss of a step passes whatever its value."""
    wrap(_compare(), "check_tensor", _passing(lambda n: n.startswith("loss")))


@mutant(f"{COMPARE}:check_tensor", [f"{RULES}::test_a_wrong_gradient_fails",
                                     "tests/harness/test_model_verdict.py::test_a_gradient_off_by_a_constant_factor_fails_though_adam_would_hide_it"])
def gradients_unchecked():
    """Gradients pass whatever their values."""
    wrap(_compare(), "check_tensor", _passing(lambda n: n.startswith("grad ") and not n.startswith("grad norm")))


@mutant(f"{COMPARE}:check_tensor", [f"{RULES}::test_a_wrong_clipped_norm_fails"])
def clipped_norm_unchecked():
    """The total gradient norm of a clipped step passes whatever its value."""
    wrap(_compare(), "check_tensor", _passing(lambda n: n.startswith("grad norm")))


@mutant(f"{COMPARE}:check_tensor", [f"{RULES}::test_a_wrong_output_fails"])
def outputs_unchecked():
    """Op outputs (``output i``) pass whatever their values."""
    wrap(_compare(), "check_tensor", _passing(lambda n: n.startswith("output")))


@mutant(f"{COMPARE}:check_tensor", [f"{RULES}::test_an_error_far_above_the_single_device_error_fails"])
def factor_times_100():
    """The parallel error may be 400x the single-device error, not 4x."""
    wrap(_compare(), "check_tensor", lambda orig: lambda name, par, dev, ref, factor=_compare().FACTOR, **kw:
         orig(name, par, dev, ref, factor=factor * 100, **kw))


@mutant(f"{COMPARE}:check_tensor", [f"{RULES}::test_where_one_device_is_exact_the_floor_is_a_few_ulps"])
def floor_times_1000():
    """The dtype floor is 16000 ulps of the largest value, not 16."""
    wrap(_compare(), "check_tensor", lambda orig: lambda name, par, dev, ref, factor=_compare().FACTOR,
         floor_eps=_compare().FLOOR_EPS, **kw: orig(name, par, dev, ref, factor=factor, floor_eps=floor_eps * 1000, **kw))


@mutant(f"{COMPARE}:check_tensor", [f"{RULES}::test_a_vanishing_gradient_is_bounded_by_the_steps_largest_gradient"])
def gradient_scale_times_1000():
    """A gradient's floor uses 1000x the step's largest gradient."""
    def make(orig):
        def check_tensor(name, par, dev, ref, *a, scale=None, **kw):
            return orig(name, par, dev, ref, *a, scale=None if scale is None else scale * 1000, **kw)
        return check_tensor
    wrap(_compare(), "check_tensor", make)


@mutant(f"{COMPARE}:check_tensor", [f"{RULES}::test_a_nan_where_the_reference_is_finite_fails"])
def nan_in_parallel_run_ignored():
    """A NaN/inf of the parallel run where the reference is finite is read as the reference's value."""
    def make(orig):
        def check_tensor(name, par, dev, ref, *a, **kw):
            if isinstance(par, torch.Tensor) and par.is_floating_point() and isinstance(ref, torch.Tensor) \
                    and par.shape == ref.shape:
                par = torch.where(torch.isfinite(par), par, ref.to(par.dtype))
            return orig(name, par, dev, ref, *a, **kw)
        return check_tensor
    wrap(_compare(), "check_tensor", make)


@mutant(f"{COMPARE}:check_tensor", [f"{RULES}::test_integer_outputs_must_be_equal"])
def integers_within_one():
    """Integer outputs off by at most one pass."""
    def make(orig):
        def check_tensor(name, par, dev, ref, *a, **kw):
            if isinstance(par, torch.Tensor) and isinstance(dev, torch.Tensor) and par.shape == dev.shape \
                    and not (par.is_floating_point() or par.is_complex()) and par.dtype != torch.bool \
                    and bool(((par.long() - dev.long()).abs() <= 1).all()):
                par = dev
            return orig(name, par, dev, ref, *a, **kw)
        return check_tensor
    wrap(_compare(), "check_tensor", make)


@mutant(f"{COMPARE}:_none_check",
        ["tests/harness/test_model_verdict.py::test_none_passes_only_where_the_float64_reference_has_none_too"])
def missing_gradient_passes():
    """A gradient missing on either side (None) passes."""
    patch(_compare(), "_none_check", lambda name, par, dev, ref: _compare().Check(name, 0.0, 0.0, True))


@mutant(f"{COMPARE}:_shape_dtype", [f"{RULES}::test_a_wrong_dtype_fails_though_its_values_are_close"])
def shape_dtype_unchecked():
    """Shapes and dtypes are not compared (a broadcastable wrong shape passes)."""
    patch(_compare(), "_shape_dtype", lambda name, par, dev: None)


@mutant(f"{COMPARE}:check_tensor", [f"{RULES}::test_a_complex_tensor_is_compared_whole"])
def complex_real_part_only():
    """Complex tensors are judged on their real part."""
    def make(orig):
        def check_tensor(name, par, dev, ref, *a, **kw):
            if all(isinstance(t, torch.Tensor) and t.is_complex() for t in (par, dev, ref)):
                par, dev, ref = par.real.contiguous(), dev.real.contiguous(), ref.real.contiguous()
            return orig(name, par, dev, ref, *a, **kw)
        return check_tensor
    wrap(_compare(), "check_tensor", make)


@mutant(f"{COMPARE}:PARTIAL_EPS", [f"{RULES}::test_a_value_split_sum_off_by_a_partial_fails"])
def partial_bound_loose():
    """A value-split output's bound allows 1e5 ulps per partial, not 2."""
    patch(_compare(), "PARTIAL_EPS", 2e5)


@mutant(f"{COMPARE}:check_update", [f"{RULES}::test_one_wrong_element_of_an_update_fails"])
def update_99_percent():
    """An optimizer update passes when 99% of its elements are within the bound (the issue's example)."""
    def make(orig):
        def check_update(name, par, want, lr, widen=1.0):
            c = orig(name, par, want, lr, widen)
            if c.ok or par is None or want is None or par.shape != want.shape or not torch.isfinite(par).all():
                return c
            diff = (par.double() - want.double()).abs()
            bound = widen * _compare().UPDATE_EPS * torch.finfo(par.dtype).eps * (want.double().abs() + lr)
            ok = float((diff <= bound).double().mean()) >= 0.99
            return _compare().Check(name, c.err, c.tol, ok, "" if ok else c.reason)
        return check_update
    wrap(_compare(), "check_update", make)


@mutant(f"{COMPARE}:UPDATE_EPS", [f"{RULES}::test_one_wrong_element_of_an_update_fails",
                                   "tests/harness/test_model_verdict.py::test_adamw_on_shards_meets_the_update_bound_and_a_nudge_does_not"])
def update_bound_loose():
    """An update may differ by 40000 ulps, not 4."""
    patch(_compare(), "UPDATE_EPS", 4e4)


@mutant(f"{COMPARE}:check_update", [f"{RULES}::test_a_nan_after_the_step_fails"])
def update_nan_ignored():
    """A NaN/inf parameter after the step is read as the expected value."""
    def make(orig):
        def check_update(name, par, want, lr, widen=1.0):
            if isinstance(par, torch.Tensor) and isinstance(want, torch.Tensor) and par.shape == want.shape:
                par = torch.where(torch.isfinite(par), par, want)
            return orig(name, par, want, lr, widen)
        return check_update
    wrap(_compare(), "check_update", make)


@mutant(f"{COMPARE}:LOWPREC_FACTOR", [f"{RULES}::test_the_bf16_rule_catches_an_error_far_above_the_spread"])
def lowprec_factor_loose():
    """bf16 recipes: 400x the single-device spread, not 4x."""
    patch(_compare(), "LOWPREC_FACTOR", 400.0)


@mutant(f"{COMPARE}:LOWPREC_FLOOR", [f"{RULES}::test_the_bf16_floor_is_half_an_ulp_of_the_norm"])
def lowprec_floor_loose():
    """bf16 recipes: a floor of 50 ulps of the norm, not half of one."""
    patch(_compare(), "LOWPREC_FLOOR", 50.0)


@mutant(f"{COMPARE}:check_lowprec", [f"{RULES}::test_the_bf16_rule_fails_a_nan_where_the_reference_is_finite"])
def lowprec_nan_ignored():
    """bf16 recipes: NaN/inf of the parallel run read as the single-device value."""
    def make(orig):
        def check_lowprec(name, par, dev, ref, *a, **kw):
            return orig(name, torch.where(torch.isfinite(par), par, dev), dev, ref, *a, **kw)
        return check_lowprec
    wrap(_compare(), "check_lowprec", make)


@mutant(f"{COMPARE}:SpreadHistory.key", [f"{RULES}::test_each_tensor_keeps_its_own_spread"])
def spread_shared_across_tensors():
    """The spread record is one for the whole case: the noisiest tensor's spread bounds every tensor."""
    patch(_compare().SpreadHistory, "key", staticmethod(lambda name: ""))


@mutant(f"{COMPARE}:Float64Fallback.widen", [f"{RULES}::test_a_reference_that_fell_back_for_nothing_keeps_the_base_bounds"])
def fallback_widens_always():
    """The float64 fallback's wider bounds apply whether or not any operator fell back."""
    patch(_compare().Float64Fallback, "widen", property(lambda self: _compare().FALLBACK_WIDEN))


@mutant(f"{COMPARE}:FALLBACK_WIDEN", [f"{RULES}::test_a_fallback_reference_still_catches_an_error_far_above_one_device"])
def fallback_widen_huge():
    """Where the reference fell back, the bounds are 1000x wider, not 2x."""
    patch(_compare(), "FALLBACK_WIDEN", 1000.0)


@mutant(f"{COMPARE}:Float64Fallback.bounds", [f"{RULES}::test_a_reference_that_fell_back_for_nothing_keeps_the_base_bounds"])
def island_floor_always():
    """A float64 run's floor counts float32 ulps even where the model has no float32 island."""
    def bounds(self, tensor_dtype=None):
        C = _compare()
        floor = C.FLOOR_EPS * self.widen * torch.finfo(torch.float32).eps / torch.finfo(torch.float64).eps
        return {"factor": C.FACTOR * self.widen, "floor_eps": floor, "lowprec": self.lowprec,
                "history": self.spreads if self.lowprec else None}
    patch(_compare().Float64Fallback, "bounds", bounds)


@mutant(f"{COMPARE}:Float64Fallback.notes", [f"{RULES}::test_a_fallback_is_named_in_the_row"])
def fallback_unnamed():
    """The row says nothing of operators the float64 reference ran in the test dtype or promoted."""
    patch(_compare().Float64Fallback, "notes", lambda self, dtype: [])


# -- the verdict on a row -------------------------------------------------------------------------------
VERDICT = "verify/judge/verdict.py"


@mutant(f"{VERDICT}:judge", ["tests/harness/test_model_verdict.py::test_an_empty_or_short_list_of_checks_fails"])
def rank_without_checks_matches():
    """A rank that returned no checks does not fail the row."""
    def make(orig):
        def judge(answers, expected=None, modules=()):
            out = orig([a for a in answers if (a.result or {}).get("checks") or a.failure
                        or (a.result or {}).get("error") or (a.result or {}).get("unverifiable")] or answers,
                       expected, modules)
            return out
        return judge
    wrap(_verdict(), "judge", make)


@mutant(f"{VERDICT}:judge", ["tests/harness/test_model_verdict.py::test_an_empty_or_short_list_of_checks_fails"])
def expected_checks_ignored():
    """A rank lacking some expected check (a step never judged) does not fail the row."""
    wrap(_verdict(), "judge", lambda orig: lambda answers, expected=None, modules=(): orig(answers, None, modules))


@mutant(f"{VERDICT}:judge", ["tests/harness/test_model_verdict.py::"
                             "test_the_reload_check_is_the_first_plan_that_fits_or_a_note_saying_why_none_does"])
def reload_under_another_plan_not_required():
    """A rank that returns no reload of the checkpoint under another plan (none of the alternatives
    of the first plan that fits, nor the note that none does) does not fail the row."""
    wrap(_verdict(), "judge", lambda orig: lambda answers, expected=None, modules=(): orig(
        answers, None if expected is None else [n for n in expected if isinstance(n, str)], modules))


@mutant(f"{VERDICT}:judge", [f"{RULES}::test_a_check_failing_on_one_rank_fails_the_row"])
def only_rank_zero_judged():
    """Only rank 0's checks are judged."""
    wrap(_verdict(), "judge", lambda orig: lambda answers, expected=None, modules=(): orig(
        answers[:1] if all(not a.failure for a in answers) else answers, expected, modules))


@mutant(f"{VERDICT}:judge", [f"{RULES}::test_an_unverifiable_rank_is_never_a_match"])
def unverifiable_is_match():
    """A rank that found the case unverifiable (a random draw it cannot judge) is ignored."""
    def make(orig):
        def judge(answers, expected=None, modules=()):
            keep = [a for a in answers if not (a.result or {}).get("unverifiable")]
            return orig(keep, expected, modules) if keep else (_verdict().MATCH, "", [], "")
        return judge
    wrap(_verdict(), "judge", make)


@mutant(f"{VERDICT}:judge", [f"{RULES}::test_a_crashed_rank_fails_the_row"])
def crashed_rank_ignored():
    """A crashed rank's missing answer is left out when its peers answered."""
    def make(orig):
        def judge(answers, expected=None, modules=()):
            alive = [a for a in answers if not a.failure]
            return orig(alive or answers, expected, modules)
        return judge
    wrap(_verdict(), "judge", make)


# -- resume: loaded tensors bit for bit -----------------------------------------------------------------
@mutant("verify/cases/resume.py:exact", [f"{RULES}::test_a_loaded_tensor_must_equal_the_saved_one_bit_for_bit"])
def resume_not_bit_exact():
    """A loaded tensor passes within 1e-3 relative of the saved one (a checkpoint moves data: it must be exact)."""
    def make(orig):
        def exact(name, got, want):
            c = orig(name, got, want)
            if c.ok or got is None or want is None or got.shape != want.shape or got.dtype != want.dtype:
                return c
            close = torch.allclose(got.double(), want.double(), rtol=1e-3, atol=1e-6)
            return _compare().Check(name, c.err, 0.0, close, "" if close else c.reason)
        return exact
    wrap(_resume(), "exact", make)


# -- localisation: the first failing tensor, forward before backward ------------------------------------
TRACE = "verify/localize/tensor_trace.py"


def _ratio(e):
    return e.check.ratio


@mutant(f"{TRACE}:Trace.first", [f"{RULES}::test_localisation_names_the_first_failing_tensor_not_the_worst"])
def localize_worst_not_first():
    """Localisation names the worst tensor instead of the first one beyond its bound."""
    patch(_tensor_trace().Trace, "first", property(
        lambda self: max((e for e in self.entries if not e.check.ok), key=_ratio, default=None)))


@mutant(f"{TRACE}:Trace.first", [f"{RULES}::test_localisation_looks_at_forward_values_before_gradients"])
def localize_backward_first():
    """Localisation looks at gradients before forward values."""
    patch(_tensor_trace().Trace, "first", property(lambda self: next(
        (e for e in sorted(self.entries, key=lambda e: e.direction != "backward") if not e.check.ok), None)))


@mutant("verify/cases/resume.py:zero_plan_b",
        ["tests/compiler/test_zero.py::test_a_zero_checkpoint_resumes_into_a_plan_that_shards_its_optimizer_state"])
def zero_resume_unsharded():
    """A ZeRO checkpoint resumes into plan B without ZeRO (every moment loaded whole: a sharded load that
    cuts the state wrong is never exercised)."""
    R = _resume()
    patch(R, "zero_plan_b", lambda policy, world_size, zero: (*R.plan_b(policy, world_size), 0))
