"""Harness mutants of the kink rules (``verify/cases/kinks.py``, ``verify/judge/kinks.py``): a failing step
explained by any flips at all, the float64 reference not following the run's side (so one device's own
kink flip widens every bound of the step), a failing step never explained."""
from __future__ import annotations

from ._base import mutant, patch, wrap

KINKS = "tests/harness/test_kinks.py"


def _judge_kinks():
    from verify.judge import kinks
    return kinks


def _case_kinks():
    from verify.cases import kinks
    return kinks


@mutant("verify/judge/kinks.py:explain", [f"{KINKS}::test_a_correct_program_at_a_kink_passes_and_a_wrong_one_still_fails",
                                         f"{KINKS}::test_explain_takes_off_only_what_mends_every_tensor"])
def kinks_explain_anything():
    """Any failing step with a near-kink value counts as explained: its checks pass as they stood."""
    def make(orig):
        def explain(grads, judge, contributions):
            chosen, checks = orig(grads, judge, contributions)
            from verify.judge.compare import Check
            return (chosen or list(range(len(contributions)))), [Check(c.name, c.err, max(c.tol, c.err), True) for c in checks]
        return explain
    wrap(_judge_kinks(), "explain", make)


@mutant("verify/cases/kinks.py:KinkFollow", [f"{KINKS}::test_one_devices_own_kink_flip_widens_no_bound"])
def kinks_not_followed():
    """The float64 reference keeps its own side of every kink: one device's flip widens the step's bounds."""
    class Unfollowing(_case_kinks().KinkFollow):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    patch(_case_kinks(), "KinkFollow", Unfollowing)


@mutant("verify/cases/kinks.py:rescue", [f"{KINKS}::test_kink_models_over_5_seeds"])
def kinks_never_explained():
    """A failing step is never explained by kinks: a correct program at a kink is a MISMATCH."""
    patch(_case_kinks(), "rescue", lambda checks, *a, **kw: checks)
