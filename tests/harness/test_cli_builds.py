"""``verify model`` builds the user's model once before any rank starts (its checks, the pipeline's
layer count and the replication summary all read that one build)."""
from __future__ import annotations

import pytest

import verify.cli as cli
import verify.models.registry as registry
from verify.runner import gang


class _Started(Exception):
    pass


@pytest.mark.parametrize("policies", [["dp"], ["dp", "pp"]])
def test_the_model_is_built_once_before_the_ranks_start(policies, monkeypatch):
    builds = []
    real = registry.MODELS["nanogpt"]
    monkeypatch.setitem(registry.MODELS, "nanogpt", lambda seed: builds.append(seed) or real(seed))

    def start(self, *a, **k):
        raise _Started
    monkeypatch.setattr(gang.Gang, "__init__", start)
    with pytest.raises(_Started):
        cli.main(["model", "nanogpt", "--policy", *policies, "--world-size", "2"])
    assert len(builds) == 1
