"""The real-size memory measurements on record (``bench/calibration/memory_record.py``) as
``bench/calibration/autodist.py`` prints them: a plan's memory is judged against today's estimate only where the
record holds it in the same configuration; a plan the search moved, or never measured, says so."""
from __future__ import annotations

import dataclasses

import pytest

from nnscaler import ComputeConfig
from nnscaler.cluster.search import search

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def plans():
    from bench.calibration.llama_models import llama_shape
    shape = llama_shape("llama3-8b", 4096)
    cfg = ComputeConfig(8, profile="h100", precision="bf16-mixed", global_batch=16)
    best = search(shape, cfg)
    other = search(shape, dataclasses.replace(cfg, constraints={"tp": 1 if best.parallel.tp > 1 else 2}))
    return best, other


def test_a_plan_is_judged_against_todays_estimate_only_in_the_configuration_measured(plans, tmp_path):
    from bench.calibration.autodist import memory_summary
    from bench.calibration.memory_record import put
    from bench.calibration.real_memory import memory_line
    from bench.calibration.real_memory import estimated
    best, other = plans
    path = tmp_path / "real_memory.json"
    line, ratio = memory_line("p", best, path=path)
    assert ratio is None and "not measured at real size" in line and "--plans p" in line
    est = estimated(best)
    put("p", best, {**est, "peak": est["peak"] / 1.25, "held": 0.0}, True, path)  # the estimate 25% over
    line, ratio = memory_line("p", best, path=path)
    assert ratio == pytest.approx(0.25) and "25% (goal 10%)" in line
    put("p", best, {**est, "held": 0.0}, True, path)  # measured again: the last measurement stands
    assert memory_line("p", best, path=path)[1] == pytest.approx(0.0)
    line, ratio = memory_line("p", other, path=path)  # the search moved the plan: not this configuration's figure
    assert ratio is None and "in another configuration" in line
    assert memory_summary([None, 0.05, 0.25]) == ("memory measured at real size: 2/3 plans in their current "
                                                  "configuration, 1 within 10% of the estimate (goal: every plan), "
                                                  "worst 25%")
