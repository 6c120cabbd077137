"""The harness's own rules, each shown both ways at unit level (no ranks): a known-wrong value, cache key,
shard set or reduced plan is caught, a right one passes. Each test kills mutants of the harness mutant
catalogue (``tests/mutants/harness``): the comparison rules and bounds, the verdict, the resume's bit-for-bit
load, localisation's choice, the cache key, the selection, shard/merge and the reduced plan."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from nnscaler.cluster.cost import Parallel
from verify.sweep.cache import VerdictCache
from verify.config import RunConfig
from verify.judge.row import Row
from verify.cases.resume import exact
from verify.cases.spread import TieFlips
from verify.localize.tensor_trace import Entry, Record, Trace
from verify.judge.compare import (FACTOR, FLOOR_EPS, Check, Float64Fallback, SpreadHistory, check_lowprec, check_tensor,
                                  check_update)
from verify.judge.verdict import MATCH, MISMATCH, UNVERIFIABLE, judge
from verify.sweep.merge import merge
from verify.models.saved_plan import reduce_parallel
from verify.judge.answer import RankAnswer
from verify.sweep.selection import Unit
from verify.sweep.shard import ShardError, check_shards
from verify.runner.worker import load_modules

ROOT = Path(__file__).resolve().parents[2]
F32, F64 = torch.float32, torch.float64


def _pair(par, dev=(1.0, 2.0), ref=(1.0, 2.0), dtype=F32):
    return torch.tensor(par, dtype=dtype), torch.tensor(dev, dtype=dtype), torch.tensor(ref, dtype=F64)


# -- comparison rules: loss, gradients, outputs, clipped norm ------------------------------------------------
@pytest.mark.parametrize("name", ["loss step 0", "grad w step 1", "grad norm step 0", "output 0", "grad of input 0"])
def test_a_value_far_off_fails_under_every_check_name(name):
    right = check_tensor(name, *_pair((1.0, 2.0)))
    wrong = check_tensor(name, *_pair((1.5, 2.0)))
    assert right.ok and not wrong.ok and "tolerance" in wrong.reason


def test_a_wrong_loss_fails():
    test_a_value_far_off_fails_under_every_check_name("loss step 2")


def test_a_wrong_gradient_fails():
    test_a_value_far_off_fails_under_every_check_name("grad model.fc.weight step 0")


def test_a_wrong_clipped_norm_fails():
    test_a_value_far_off_fails_under_every_check_name("grad norm step 1")


def test_a_wrong_output_fails():
    test_a_value_far_off_fails_under_every_check_name("output 0")


def test_an_error_far_above_the_single_device_error_fails():
    dev = (1.0 + 1e-5, 2.0)  # one device off by 1e-5: the parallel run may lose FACTOR times that, not 100x
    assert check_tensor("g", *_pair((1.0 + 3e-5, 2.0), dev)).ok
    assert not check_tensor("g", *_pair((1.0 + 1e-3, 2.0), dev)).ok


def test_where_one_device_is_exact_the_floor_is_a_few_ulps():
    eps = torch.finfo(F32).eps
    assert check_tensor("g", *_pair((1.0 + eps, 2.0))).ok  # one ulp: a reordered sum may round
    c = check_tensor("g", *_pair((1.0 + 1e-5, 2.0)))
    assert not c.ok and c.tol == pytest.approx(FLOOR_EPS * eps * 2.0)


def test_a_vanishing_gradient_is_bounded_by_the_steps_largest_gradient():
    par, dev, ref = _pair((1e-4, 0.0), (0.0, 0.0), (0.0, 0.0))
    assert not check_tensor("grad b step 0", par, dev, ref, scale=1.0).ok
    assert check_tensor("grad b step 0", *_pair((1e-7, 0.0), (0.0, 0.0), (0.0, 0.0)), scale=1.0).ok


def test_a_nan_where_the_reference_is_finite_fails():
    c = check_tensor("g", *_pair((float("nan"), 2.0)))
    assert not c.ok and "NaN" in c.reason
    assert check_tensor("g", *_pair((float("nan"), 2.0), (float("nan"), 2.0), (float("nan"), 2.0))).ok


def test_integer_outputs_must_be_equal():
    i = lambda *v: torch.tensor(v)  # noqa: E731
    assert check_tensor("output 0", i(1, 2, 3), i(1, 2, 3), i(1, 2, 3)).ok
    assert not check_tensor("output 0", i(1, 2, 4), i(1, 2, 3), i(1, 2, 3)).ok


def test_a_wrong_dtype_fails_though_its_values_are_close():
    ref = torch.linspace(-1, 1, 64, dtype=F64)
    c = check_tensor("output 0", ref.half(), ref.float(), ref)  # float16 where the run is float32: a coarser bound
    assert not c.ok and "dtype" in c.reason
    assert not check_tensor("output 0", ref.float()[:32], ref.float(), ref).ok


def test_a_complex_tensor_is_compared_whole():
    ref = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex128)
    dev = ref.to(torch.complex64)
    assert check_tensor("output 0", dev.clone(), dev, ref).ok
    assert not check_tensor("output 0", dev + 0.5j, dev, ref).ok  # the imaginary part is wrong


def test_a_value_split_sum_off_by_a_partial_fails():
    eps = torch.finfo(F32).eps
    assert check_tensor("output 0", *_pair((1.0 + 16 * eps, 2.0)), partials=10.0).ok  # rounding of the partials
    assert not check_tensor("output 0", *_pair((1.0 + 1e-3, 2.0)), partials=10.0).ok


# -- optimizer updates ----------------------------------------------------------------------------------
def test_one_wrong_element_of_an_update_fails():
    want = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    want[0] = 1.0
    par = want.clone()
    assert check_update("param w after step 0", par, want, 1e-3).ok
    par[0] += 1e-4  # one element of a thousand (a ZeRO slice edge), far above a few ulps
    c = check_update("param w after step 0", par, want, 1e-3)
    assert not c.ok and "element 0" in c.reason


def test_a_nan_after_the_step_fails():
    want = torch.ones(4)
    par = want.clone()
    par[1] = float("nan")
    assert not check_update("param w after step 0", par, want, 1e-3).ok


# -- bf16 recipes -----------------------------------------------------------------------------------------
def _bf16(rel: float, seed: int = 0):
    ref = torch.randn(1000, generator=torch.Generator().manual_seed(seed), dtype=F64)
    dev = ref.bfloat16()
    return (dev.double() + rel * ref).bfloat16(), dev, ref


def test_the_bf16_rule_catches_an_error_far_above_the_spread():
    par, dev, ref = _bf16(0.0)
    assert check_lowprec("grad w step 0", par, dev, ref).ok
    assert not check_lowprec("grad w step 0", *_bf16(0.05)).ok


def test_the_bf16_floor_is_half_an_ulp_of_the_norm():
    ref = torch.randn(1000, generator=torch.Generator().manual_seed(1), dtype=F64)
    exact_dev = ref.float()  # a tensor the single-device run gets (almost) exact: the floor bounds it
    assert check_lowprec("loss step 0", (ref * (1 + 1e-3)).float(), exact_dev, ref).ok
    assert not check_lowprec("loss step 0", (ref * 1.01).float(), exact_dev, ref).ok


def test_the_bf16_rule_fails_a_nan_where_the_reference_is_finite():
    par, dev, ref = _bf16(0.0)
    par[3] = float("nan")
    assert not check_lowprec("grad w step 0", par, dev, ref).ok


def test_each_tensor_keeps_its_own_spread():
    history = SpreadHistory()
    history.add("grad noisy", 0.5)  # another tensor's spread: it must not bound this one
    par, dev, ref = _bf16(0.1, seed=2)
    assert not check_lowprec("grad quiet step 0", par, dev, ref, history=history).ok
    history.add("grad quiet", 0.5)
    assert check_lowprec("grad quiet step 0", par, dev, ref, history=history).ok


# -- the float64 fallback ---------------------------------------------------------------------------------
def test_a_reference_that_fell_back_for_nothing_keeps_the_base_bounds():
    for dtype in (F32, F64):
        b = Float64Fallback(dtype).bounds()
        assert (b["factor"], b["floor_eps"]) == (FACTOR, FLOOR_EPS)


def test_a_fallback_reference_still_catches_an_error_far_above_one_device():
    mode = Float64Fallback(F32)
    mode.used.add("aten._grouped_mm.default")
    b = mode.bounds()
    dev = (1.0 + 1e-5, 2.0)
    assert check_tensor("g", *_pair((1.0 + 5e-5, 2.0), dev), **b).ok  # widened: 8x the single-device error
    assert not check_tensor("g", *_pair((1.0 + 1e-3, 2.0), dev), **b).ok


def test_a_fallback_is_named_in_the_row():
    mode = Float64Fallback(F32)
    mode.used.add("aten._grouped_mm.default")
    mode.promoted.add("aten.softmax.default")
    text = " ".join(c.name for c in mode.notes("float32"))
    assert "aten._grouped_mm.default" in text and "aten.softmax.default" in text


# -- the verdict on a row -----------------------------------------------------------------------------------
def _answer(rank: int, ok: bool = True) -> RankAnswer:
    return RankAnswer(rank, {"checks": [{"name": "loss step 0", "err": 0.0 if ok else 1.0, "tol": 0.1, "ok": ok,
                                         "reason": "" if ok else "error 1 > tolerance 0.1"}]})


def test_a_check_failing_on_one_rank_fails_the_row():
    assert judge([_answer(0), _answer(1)])[0] == MATCH
    status, detail, _, _ = judge([_answer(0), _answer(1, ok=False)])
    assert status == MISMATCH and "rank 1" in detail


def test_an_unverifiable_rank_is_never_a_match():
    status, detail, _, _ = judge([_answer(0), RankAnswer(1, {"unverifiable": "aten.randn at model.py:3"})])
    assert status == UNVERIFIABLE and "randn" in detail


def test_a_crashed_rank_fails_the_row():
    status, _, _, _ = judge([_answer(0), RankAnswer(1, None, "rank 1 died (signal 9)", "crash", -9)])
    assert status != MATCH


# -- resume: a checkpoint moves data --------------------------------------------------------------------
def test_a_loaded_tensor_must_equal_the_saved_one_bit_for_bit():
    saved = torch.randn(16)
    assert exact("param w", saved.clone(), saved).ok
    one_ulp = torch.nextafter(saved, torch.full_like(saved, float("inf")))
    assert not exact("param w", one_ulp, saved).ok


# -- localisation: the first failing tensor, forward before backward --------------------------------------
def _entry(tensor: str, direction: str, ratio: float) -> Entry:
    rec = Record("out", f"op_{tensor}", tensor, "R", "R")
    return Entry(rec, direction, Check(tensor, ratio, 1.0, ratio <= 1.0))


def test_localisation_names_the_first_failing_tensor_not_the_worst():
    trace = Trace([_entry("a", "forward", 0.5), _entry("b", "forward", 2.0), _entry("c", "forward", 100.0)])
    assert trace.first.record.tensor == "b"  # c may only carry b's error downstream


def test_localisation_looks_at_forward_values_before_gradients():
    trace = Trace([_entry("a", "forward", 0.5), _entry("b", "forward", 2.0), _entry("b", "backward", 50.0)])
    assert (trace.first.record.tensor, trace.first.direction) == ("b", "forward")


# -- tie-flip samples -------------------------------------------------------------------------------------
def test_a_clear_winner_is_never_flipped_as_a_tie():
    scores64 = torch.tensor([[0.1, 0.7, 0.3], [0.4, 0.4 + 1e-9, 0.2]], dtype=F64)
    with TieFlips([scores64]) as mode:
        torch.topk(scores64.float(), 1, dim=-1)
    assert mode.flips == 1  # the near-tie of row 1 only, never row 0's clear winner


# -- the verdict cache key: every setting that changes a program ------------------------------------------
@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    for pkg in ("nnscaler", "verify", "opzoo"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return src


@pytest.fixture(scope="module")
def registry():
    return load_modules(())


UNIT = Unit("model", "nanogpt", "tp", (2,), (0,))
SETTINGS = {"dtype": {"dtype": "float64"}, "precision": {"precision": "bf16-mixed"}, "zero": {"zero": 1},
            "clip": {"clip_grad_norm": 1.0}, "recompute": {"recompute": "full"}, "grad_reduce_dtype":
            {"grad_reduce_dtype": "bf16"}, "partition": {"partition": "m=2"}, "base": {"base_override": 2}}


@pytest.mark.parametrize("field", [*SETTINGS, "modules", "torch", "core"])
def test_every_setting_that_changes_a_program_is_in_the_cache_key(field, tree, registry, tmp_path, monkeypatch):
    base = VerdictCache(tmp_path, RunConfig(world_sizes=(2,)), registry, root=tree).key(UNIT)
    change = dict(SETTINGS.get(field, {}))
    core = tree / "nnscaler" / "runtime" / "collectives.py"
    text = core.read_text()
    if field == "modules":
        (tmp_path / "ops.py").write_text("# a user's operators\n")
        change["modules"] = (str(tmp_path / "ops.py"),)
    elif field == "torch":
        monkeypatch.setattr(torch, "__version__", "0.0.0")
    elif field == "core":
        core.write_text(text + "\n# edited\n")
    try:
        other = VerdictCache(tmp_path, RunConfig(world_sizes=(2,), **change), registry, root=tree).key(UNIT)
    finally:
        core.write_text(text)
    assert other != base


UNIT_CHANGES = {"world_sizes": (4,), "seeds": (1,), "policy": "dp", "steps": 2, "microbatches": 4, "replicas": 2,
                "checkpoint": False, "recipe": True}


@pytest.mark.parametrize("field, value", [pytest.param(f, v, id=f) for f, v in UNIT_CHANGES.items()])
def test_every_field_of_a_unit_is_in_the_cache_key(field, value, tree, registry, tmp_path):
    cache = VerdictCache(tmp_path, RunConfig(world_sizes=(2,)), registry, root=tree)
    assert cache.key(dataclasses.replace(UNIT, **{field: value})) != cache.key(UNIT)


# -- selection ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def default():
    from tests.harness.test_selection import MODEL_NAMES, POLICIES, RANDOM_SEEDS, TORCH_CASES  # the matrix as tested there
    from verify.sweep.selection import ZOO, default_units, full_units, saved_plans
    full = full_units(["relu"], MODEL_NAMES, list(POLICIES), (2, 4), (0,), RANDOM_SEEDS, [4], TORCH_CASES, True,
                      zoo=ZOO, plans=saved_plans())
    return default_units(full, MODEL_NAMES, list(POLICIES), (2, 4), RANDOM_SEEDS)


def test_the_default_sample_runs_a_zoo_architecture(default):
    from verify.sweep.selection import ZOO_DEFAULT
    assert {u.name for u in default} & {f"zoo:{a}" for a in ZOO_DEFAULT}


def test_the_default_sample_resumes_some_checkpoints(default):
    assert any(u.checkpoint for u in default if u.kind == "model")


# -- shards and merge ---------------------------------------------------------------------------------------
def test_shards_with_a_unit_unfinished_are_refused():
    metas = [{"selection": "s", "shards": 2, "shard": 1, "units": ["a"], "total": 3},
             {"selection": "s", "shards": 2, "shard": 2, "units": ["b"], "total": 3}]
    with pytest.raises(ShardError, match="did not finish"):
        check_shards(metas)
    metas[1]["units"] = ["b", "c"]
    check_shards(metas)


def _report(directory: Path, shard: int, rows: list[Row], units: list[str], config=None) -> str:
    directory.mkdir(parents=True)
    sweep = {"selection": "sel", "shards": 2, "shard": shard, "units": units, "total": 2}
    (directory / "report.json").write_text(json.dumps({"config": config or {"dtype": "float32"}, "sweep": sweep,
                                                       "cases": [r.to_json() for r in rows]}))
    return str(directory)


def _merge_row(status: str) -> Row:
    return Row("model:nanogpt", "model", "", 2, "tp", "float32", 0, status, detail="" if status == MATCH else "x")


def test_a_case_in_two_shards_is_never_silently_dropped(tmp_path):
    a = _report(tmp_path / "a", 1, [_merge_row(MATCH)], ["u1"])
    b = _report(tmp_path / "b", 2, [_merge_row(MISMATCH)], ["u2"])  # the same case again, rerun: it failed
    try:
        merge([a, b], str(tmp_path / "out"))
    except ShardError as exc:  # refused, naming the case
        assert "nanogpt" in str(exc)
        return
    rows = [json.loads(line) for line in (tmp_path / "out" / "cases.jsonl").read_text().splitlines()]
    assert sorted(r["status"] for r in rows) == sorted([MATCH, MISMATCH])  # or both kept


def test_shards_run_with_other_settings_are_refused(tmp_path):
    a = _report(tmp_path / "a", 1, [_merge_row(MATCH)], ["u1"])
    b = _report(tmp_path / "b", 2, [dataclasses.replace(_merge_row(MATCH), seed=1)], ["u2"], {"dtype": "float64"})
    with pytest.raises(ShardError, match="other settings"):
        merge([a, b], str(tmp_path / "out"))


# -- the reduced plan keeps every field of the saved one ------------------------------------------------------
def test_the_reduced_plan_keeps_every_field_of_the_saved_one():
    saved = Parallel(tp=4, pp=4, dp=4, micro_batch_size=2, num_microbatches=8, virtual_stages=2,
                     sequence_parallel=True, zero=3, recompute="selective")
    got = reduce_parallel(saved)
    assert (got.tp, got.pp, got.dp) == (2, 2, 2)  # every axis kept, each of 2
    assert (got.virtual_stages, got.schedule, got.sequence_parallel, got.zero, got.recompute) == \
        (2, "Interleaved1F1B", True, 3, "selective")
    assert got.num_microbatches > 1 and got.num_microbatches % got.pp == 0
    assert reduce_parallel(dataclasses.replace(saved, zero=2)).zero == 2
    cp = reduce_parallel(dataclasses.replace(saved, cp=16, cp_scheme="ring", cp_balanced=False))
    assert (cp.cp, cp.cp_scheme, cp.cp_balanced) == (2, "ring", False)  # the cp axis kept, of 2
    # four axes would need 16 ranks: dp (the same program on other rows) gives way, the others are kept
    assert (cp.tp, cp.cp, cp.pp, cp.dp, cp.world) == (2, 2, 2, 1, 8)
    assert reduce_parallel(dataclasses.replace(saved, cp=16), as_planned=True).world == 4 * 16 * 4 * 4
    assert reduce_parallel(dataclasses.replace(saved, cp=4)).cp_balanced
    # a plan interleaving 8 virtual stages (the 405B plans) stays interleaved, with 2: 8 ran out of memory here
    v8 = reduce_parallel(dataclasses.replace(saved, virtual_stages=8))
    assert (v8.virtual_stages, v8.schedule) == (2, "Interleaved1F1B")
    assert reduce_parallel(dataclasses.replace(saved, virtual_stages=8), as_planned=True).virtual_stages == 8


def test_the_reduced_plan_keeps_the_precision_and_a_batch_every_rank_divides(tmp_path):
    for par in (Parallel(tp=2, dp=2), Parallel(tp=4, dp=2, micro_batch_size=3), Parallel(pp=2, dp=3)):
        got = reduce_parallel(par)
        assert (got.dp * got.micro_batch_size) % got.world == 0, got
    pytest.importorskip("transformers")
    from nnscaler.cluster.plan import load
    from tests.fixtures.llama_meta import saved_plan
    from verify.models.saved_plan import reduce
    _, path = saved_plan(tmp_path, 8, {"tp": 2, "dp": 4, "zero": 1})
    assert reduce(load(path))["precision"] == "bf16-mixed"
