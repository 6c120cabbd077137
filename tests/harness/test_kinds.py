"""The case kinds a rank answers are registered (``verify/kinds/``): the runner looks a job's kind up and
knows none of them, so a new kind is one module (here, one class in a test) and nothing in the runner."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from verify.kinds import KINDS, CaseKind, UnknownKind, case_kind, kind_of
from verify.runner.worker import RankState, handle

BUILT_IN = {"op_partitions", "op", "conversion", "accumulation", "model", "torchpar", "plan"}


def state() -> RankState:
    return RankState(0, None, None, torch.device("cpu"))


def test_every_built_in_kind_is_registered_under_one_name():
    assert BUILT_IN <= set(KINDS)
    assert all(cls.name == name for name, cls in KINDS.items())


def test_a_job_crosses_as_its_dict():
    job = {"kind": "model", "model": "nanogpt", "policy": "dp", "world_size": 2, "plan_ngpus": 1}
    case = kind_of(job)
    assert type(case) is KINDS["model"] and case.to_dict() == job and case.replicas


def test_an_unknown_kind_is_an_error_answer_not_a_dead_rank():
    with pytest.raises(UnknownKind):
        kind_of({"kind": "nope"})
    answer = handle(state(), {"kind": "nope"})
    assert answer["error_type"] == "UnknownKind" and "op_partitions" in answer["error"]


def test_a_new_kind_runs_through_the_runner_untouched():
    @case_kind("echo_for_test")
    @dataclass(frozen=True)
    class Echo(CaseKind):
        def run(self, state) -> dict:
            state.kept["runs"] = state.kept.get("runs", 0) + 1
            return {"echo": self.job["value"]}

    try:
        s = state()
        answers = [handle(s, {"kind": "echo_for_test", "value": v}) for v in (1, 2)]
        assert [a["echo"] for a in answers] == [1, 2] and s.kept["runs"] == 2
        assert all(a["seconds"] >= 0 for a in answers)
        with pytest.raises(ValueError, match="registered twice"):
            case_kind("echo_for_test")(Echo)
    finally:
        del KINDS["echo_for_test"]
