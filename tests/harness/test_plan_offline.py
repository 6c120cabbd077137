"""plan_model(verify=...): planning without a process group verifies the plan's (operator, partition)
pairs on a local gang it launches (forked, so a user's custom ops come along); a wrong annotation is
refused (strict) or warned (warn) naming the operator and the partition; a corrupt cache is ignored
and rebuilt, an unusable one costs only time; a filled cache launches nothing."""
from __future__ import annotations

import json
import warnings

import pytest

import opzoo  # noqa: F401
from nnscaler import ComputeConfig, PlanError, plan_model
from nnscaler import UnverifiedPlanWarning
from verify.models.registry import MODELS
from verify.plan.offline import verify_offline


@pytest.mark.parametrize("corrupt", [b"{not json", b"\x00\xff\xfe garbage", b'{"k": {"ok": "yes"}}', b"[1, 2]"])
def test_offline_refuses_a_wrong_annotation_and_rebuilds_a_corrupt_cache(registry, tmp_path, corrupt):  # registry: the fixture files, wrong_model.py too
    cache = tmp_path / "verdicts.json"
    cache.write_bytes(corrupt)
    case = MODELS["wrong_softmax_head"](0)
    with pytest.raises(PlanError, match=r"row_softmax \(wrong_row_softmax\) under b=2"):
        plan_model(case.model, case.batch(0), "tp", ComputeConfig(2), verify="strict", verify_cache=cache)
    rebuilt = json.loads(cache.read_text())  # valid again, holding the failing verdict
    assert any(v.get("ok") is False and v["spec"] == "wrong_row_softmax" for v in rebuilt.values())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plan = plan_model(case.model, case.batch(0), "tp", ComputeConfig(2), verify="warn", verify_cache=cache)
    assert plan.world_size == 2
    assert any(issubclass(w.category, UnverifiedPlanWarning) and "wrong_row_softmax" in str(w.message) for w in seen)


def test_offline_passes_a_right_model_and_then_launches_nothing(registry, tmp_path):
    cache = tmp_path / "verdicts.json"
    case = MODELS["nanogpt"](0)
    plan = plan_model(case.model, case.batch(0), "tp", ComputeConfig(2), verify="strict", verify_cache=cache)
    from nnscaler.trace.build import trace
    graph = trace(case.model, case.batch(0))
    from nnscaler.compile.plan import canonical_params
    canonical_params(case.model, graph)
    again = verify_offline(graph, plan, cache_path=cache)  # every verdict from the cache: no gang
    assert again and all(v.ok and v.cached for v in again)


def test_an_unusable_cache_costs_time_never_correctness(registry, tmp_path):
    cache = tmp_path / "verdicts.json"
    cache.mkdir()  # a directory where the cache file should be
    case = MODELS["wrong_softmax_head"](0)
    with pytest.raises(PlanError, match="wrong_row_softmax"):  # still verified, still refused
        plan_model(case.model, case.batch(0), "tp", ComputeConfig(2), verify="strict", verify_cache=cache)
    assert cache.is_dir() and not any(cache.iterdir())


def test_bad_verify_values_are_refused(registry):
    case = MODELS["wrong_softmax_head"](0)
    with pytest.raises(PlanError, match="verify must be 'strict', 'warn' or False"):
        plan_model(case.model, case.batch(0), "tp", ComputeConfig(2), verify="yes")
