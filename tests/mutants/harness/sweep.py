"""Harness mutants of the sweep: the selection of units (``verify/sweep/selection.py``), the verdict cache key
(``verify/sweep/cache.py``), the shares of a sharded run and their merge (``verify/sweep/shard.py``, ``verify/sweep/merge.py``)."""
from __future__ import annotations

import dataclasses

from ._base import _cache, _merge, _selection, _shard, mutant, patch, wrap

RULES = "tests/harness/test_harness_rules.py"
CACHE = "verify/sweep/cache.py"
SEL = "tests/harness/test_selection.py"

# -- the verdict cache key: every setting that changes a program ----------------------------------------
# run setting -> its path in the key's context: the recipe's settings live in the one Recipe object (its
# fields under ``context["recipe"]``), the others at the top.
CONTEXT = {"dtype": ("dtype",), "precision": ("recipe", "precision"), "zero": ("recipe", "zero"),
           "clip": ("recipe", "clip_grad_norm"), "recompute": ("recipe", "recompute"),
           "grad_reduce_dtype": ("recipe", "grad_reduce_dtype"), "partition": ("partition",), "base": ("base",),
           "modules": ("modules",), "torch": ("torch",), "core": ("core",)}


def _drop_context(field: str, path: tuple[str, ...] | None = None):
    *parents, leaf = path or (field,)

    def apply():
        def make(orig):
            def __init__(self, *a, **kw):
                orig(self, *a, **kw)
                where = self.context
                for p in parents:
                    where = where[p]
                where.pop(leaf)  # a KeyError here means the key moved: the mutant must follow it
            return __init__
        wrap(_cache().VerdictCache, "__init__", make)
    apply.__name__ = f"cache_key_omits_{field}"
    apply.__doc__ = f"The verdict cache key leaves out the run's ``{field}``: a verdict is reused for another program."
    return apply


for _field, _path in CONTEXT.items():
    mutant(f"{CACHE}:VerdictCache.context[{']['.join(_path)}]",
           [f"{RULES}::test_every_setting_that_changes_a_program_is_in_the_cache_key[{_field}]"])(
        _drop_context(_field, _path))

for _field in ("layout", "node"):  # the run config's other program-changing fields, keyed by their own test
    mutant(f"{CACHE}:VerdictCache.context[{_field}]",
           ["tests/harness/test_verdict_cache.py::test_every_field_of_the_run_config_that_changes_a_program_is_in_the_key"])(
        _drop_context(_field))

UNIT_FIELDS = {"world_sizes": (), "seeds": (), "policy": "", "steps": 3, "microbatches": 1, "replicas": 1,
               "checkpoint": True, "recipe": False}


def _drop_unit(field: str, value):
    def apply():
        wrap(_cache().VerdictCache, "key", lambda orig: lambda self, unit: orig(
            self, dataclasses.replace(unit, **{field: value})))
    apply.__name__ = f"cache_key_omits_unit_{field}"
    apply.__doc__ = f"The verdict cache key leaves out the unit's ``{field}``."
    return apply


def _ignore_recipe_field(field: str):
    def apply():
        def make(orig):
            def __init__(self, *a, **kw):
                orig(self, *a, **kw)
                self.context["recipe"].pop(field)
            return __init__
        wrap(_cache().VerdictCache, "__init__", make)
    apply.__name__ = f"cache_key_ignores_recipe_{field}"
    apply.__doc__ = f"The verdict cache key leaves out the recipe's ``{field}``: a verdict is reused for another recipe."
    return apply


for _field in ("num_microbatches", "precision", "zero", "clip_grad_norm", "recompute", "grad_reduce_dtype",
               "bucket_bytes", "recompute_modules"):
    mutant(f"{CACHE}:VerdictCache.context[recipe][{_field}]",
           [f"tests/harness/test_kinds_sweep.py::test_the_cache_key_changes_when_any_recipe_field_changes[{_field}]",
            "tests/harness/test_verdict_cache.py::test_every_field_of_the_recipe_is_in_the_key"])(
        _ignore_recipe_field(_field))

for _field, _value in UNIT_FIELDS.items():
    mutant(f"{CACHE}:VerdictCache.key", [f"{RULES}::test_every_field_of_a_unit_is_in_the_cache_key[{_field}]"])(
        _drop_unit(_field, _value))


@mutant(f"{CACHE}:VerdictCache.key",
        ["tests/harness/test_verdict_cache.py::test_a_saved_plan_unit_reruns_when_its_plan_file_changes"])
def cache_key_omits_plan_file():
    """A saved plan unit's key leaves out the plan file's content (an edited plan keeps its old verdict)."""
    wrap(_cache().VerdictCache, "key", lambda orig: lambda self, unit: orig(
        self, dataclasses.replace(unit, kind="model") if unit.kind == "plan" else unit))


@mutant(f"{CACHE}:VerdictCache.put",
        ["tests/harness/test_verdict_cache.py::test_failures_are_never_kept_and_a_unit_that_says_nothing_depends_on_every_leaf"])
def cache_keeps_failures():
    """A failing row is kept in the cache (and a rerun reports it as it was, never rerunning the fix)."""
    def make(orig):
        def put(self, unit, rows, used):
            return orig(self, unit, [dataclasses.replace(r, status="match") for r in rows], used)
        return put
    wrap(_cache().VerdictCache, "put", make)


# -- the selection of units --------------------------------------------------------------------------------
@mutant("verify/sweep/selection.py:recipe_units",
        [f"{SEL}::test_full_runs_the_combined_recipe_on_every_model_and_the_default_one_unit_per_kind_cheaply"])
def no_recipe_units():
    """Neither sweep runs the combined recipe (bf16-mixed, ZeRO 3, clipping, recompute)."""
    patch(_selection(), "recipe_units", lambda models, seeds, world_sizes: [])


@mutant("verify/sweep/selection.py:default_plans", [f"{SEL}::test_every_saved_plan_runs_under_full_and_one_cheap_one_by_default"])
def default_runs_no_saved_plan():
    """The default sample verifies no saved cluster plan."""
    patch(_selection(), "default_plans", lambda full, names=(): [])


@mutant("verify/sweep/selection.py:default_zoo", [f"{RULES}::test_the_default_sample_runs_a_zoo_architecture"])
def default_runs_no_zoo():
    """The default sample runs no zoo architecture."""
    patch(_selection(), "default_zoo", lambda full: [])


@mutant("verify/sweep/selection.py:full_order", [f"{SEL}::test_full_runs_the_default_units_first_then_the_rest_each_once"])
def full_drops_its_last_unit():
    """``verify all --full`` silently leaves out its last unit."""
    wrap(_selection(), "full_order", lambda orig: lambda full, default: orig(full, default)[:-1])


@mutant("verify/sweep/selection.py:default_units", [f"{SEL}::test_no_resume_units_train_two_steps_and_are_the_first_steps_of_the_full_units",
                                               f"{RULES}::test_the_default_sample_resumes_some_checkpoints"])
def default_never_resumes():
    """No unit of the default sample checks a checkpoint resume."""
    wrap(_selection(), "default_units", lambda orig: lambda *a, **kw: [
        dataclasses.replace(u, checkpoint=False) for u in orig(*a, **kw)])


# -- shards and their merge --------------------------------------------------------------------------------
@mutant("verify/sweep/shard.py:shard", [f"{SEL}::test_shards_are_disjoint_cover_everything_and_are_the_same_on_every_call"])
def shard_drops_a_unit():
    """Each share leaves out its last unit (some units run in no shard)."""
    wrap(_shard(), "shard", lambda orig: lambda units, i, n, times=None: orig(units, i, n, times)[:-1])


def _ignoring(words: str):
    def make(orig):
        def check_shards(metas):
            try:
                orig(metas)
            except _shard().ShardError as exc:
                if words not in str(exc):
                    raise
        return check_shards
    return make


@mutant("verify/sweep/shard.py:check_shards", [f"{SEL}::test_shards_that_do_not_fit_together_are_refused",
                                          "tests/harness/test_verdict_cache.py::test_shards_merge_into_the_whole_run_and_a_missing_one_is_refused"],
        owner="merge")
def missing_shard_accepted():
    """``verify merge`` merges N-1 shares of N without a word."""
    wrap(_shard(), "check_shards", _ignoring("missing"))


@mutant("verify/sweep/shard.py:check_shards", [f"{SEL}::test_shards_that_do_not_fit_together_are_refused"], owner="merge")
def shard_of_another_run_accepted():
    """``verify merge`` merges shards of another selection (other options or code)."""
    wrap(_shard(), "check_shards", _ignoring("different selections"))


@mutant("verify/sweep/shard.py:check_shards", [f"{SEL}::test_shards_that_do_not_fit_together_are_refused"], owner="merge")
def shard_given_twice_accepted():
    """``verify merge`` takes the same shard twice."""
    wrap(_shard(), "check_shards", _ignoring("given twice"))


@mutant("verify/sweep/shard.py:check_shards", [f"{RULES}::test_shards_with_a_unit_unfinished_are_refused"], owner="merge")
def unfinished_shard_accepted():
    """``verify merge`` merges shards that together hold fewer units than the selection."""
    wrap(_shard(), "check_shards", _ignoring("some did not finish"))


@mutant("verify/sweep/merge.py:_load", [f"{RULES}::test_a_case_in_two_shards_is_never_silently_dropped"], owner="merge")
def merge_drops_duplicate_rows():
    """``verify merge`` keeps one of two rows of the same case found in two shards (a rerun's MISMATCH can vanish)."""
    seen: set = set()

    def make_merge(orig):
        def merge(directories, out):
            seen.clear()
            return orig(directories, out)
        return merge

    def make_load(orig):
        def _load(directory):
            meta, rows = orig(directory)
            keep = [r for r in rows if r.key not in seen]
            seen.update(r.key for r in rows)
            return meta, keep
        return _load
    wrap(_merge(), "merge", make_merge)
    wrap(_merge(), "_load", make_load)


@mutant("verify/sweep/merge.py:merge", [f"{RULES}::test_shards_run_with_other_settings_are_refused"], owner="merge")
def merge_ignores_settings():
    """``verify merge`` merges shards run with other settings (dtype, world sizes, seeds)."""
    def make(orig):
        def _load(directory):
            meta, rows = orig(directory)
            return {**meta, "config": None}, rows
        return _load
    wrap(_merge(), "_load", make)


@mutant("verify/sweep/selection.py:SEQUENCE_MODELS",
        [f"{SEL}::test_every_context_parallel_policy_runs_once_on_the_sequence_models_and_leaves_the_rest_as_it_was"])
def sequence_models_none():
    """``verify all`` trains no model under a context-parallel policy: no long-sequence program is verified."""
    patch(_selection(), "SEQUENCE_MODELS", ())
