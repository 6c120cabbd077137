"""Plans never quietly worse than they look: a data-parallel axis that cannot divide the batch is
refused (it would split nothing and still match), and a plan whose estimated peak per rank exceeds
the memory budget or the profile's device warns, whichever policy made it."""
from __future__ import annotations

import warnings

import pytest
import torch

from nnscaler import ComputeConfig, PlanError, PlanWarning, plan_model


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).square().mean()


@pytest.mark.parametrize("policy,world,rows", [("dp", 2, 3), ("dp", 4, 6), ("hybrid", 4, 3)])
def test_a_batch_the_data_parallel_ranks_do_not_divide_is_refused(policy, world, rows):
    with pytest.raises(PlanError) as info:
        plan_model(MLP(), (torch.randn(rows, 8),), policy, ComputeConfig(world), verify=False)
    msg = str(info.value)
    assert f"({rows} rows" in msg and "multiple of" in msg and "\n" not in msg, msg


@pytest.mark.parametrize("policy,world,rows", [("dp", 2, 4), ("hybrid", 4, 6), ("tp", 2, 3)])
def test_a_divisible_batch_or_a_policy_without_dp_plans(policy, world, rows):
    plan = plan_model(MLP(), (torch.randn(rows, 8),), policy, ComputeConfig(world), verify=False)
    assert plan.world_size == world


@pytest.mark.parametrize("policy,world", [("dp", 2), ("tp", 2), ("hybrid", 4)])
def test_a_plan_over_the_memory_budget_warns_and_one_within_it_does_not(policy, world):
    x = (torch.randn(4, 8),)
    with pytest.warns(PlanWarning, match=rf"policy {policy}: estimated peak .* exceeds mem_budget of .*would not fit"):
        plan_model(MLP(), x, policy, ComputeConfig(world, mem_budget=1024), verify=False)
    with warnings.catch_warnings(record=True) as got:  # (tp on this MLP also warns that it replicates some ops)
        warnings.simplefilter("always", PlanWarning)
        plan_model(MLP(), x, policy, ComputeConfig(world, mem_budget=2**30), verify=False)
    assert not [w for w in got if "exceeds" in str(w.message)]


def test_a_plan_larger_than_the_profile_device_warns_without_a_budget():
    """Planned on the meta device for H100s: 6.4 G parameters replicated by dp, with fp32 gradients and
    AdamW state (16 bytes a parameter, ~100 GiB per rank), cannot fit an 80 GiB device."""
    with torch.device("meta"):
        big = torch.nn.Sequential(*(torch.nn.Linear(32768, 32768) for _ in range(6)))
        x = torch.empty(4, 32768)
    with pytest.warns(PlanWarning, match="exceeds the h100 profile's device memory"):
        plan_model(big, (x,), "dp", ComputeConfig(2, profile="h100"), verify=False)


def test_the_report_says_why_each_operator_stays_whole():
    """A hidden width of 6 on 4 ranks: the linears' splittable dims (8 in, 6 out, batch 4) divide no
    axis of 4 but the batch, which tp never splits; relu (elementwise over 4 x 6) likewise."""
    class Narrow(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(6, 6)

        def forward(self, x):
            return self.a(x).square().mean()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanWarning)
        plan = plan_model(Narrow(), (torch.randn(3, 6),), "tp", ComputeConfig(4), verify=False)
    reasons = {why for _, _, why in plan.stats.replicated_ops}
    assert "indivisible" in reasons, plan.stats.replicated_ops
    assert "no splittable dim divides the mesh" in plan.report()


@pytest.mark.parametrize("rank, said", [(0, 1), (1, 0), (3, 0)])
def test_a_plan_warning_is_said_by_the_driving_rank_only(monkeypatch, rank, said):
    """Every rank of a job plans alike: its PlanWarning is said once per job (rank 0), not once per rank."""
    import torch.distributed as dist
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always", PlanWarning)
        plan_model(MLP(), (torch.randn(4, 8),), "dp", ComputeConfig(2, mem_budget=1024), verify=False)
    assert len([w for w in got if issubclass(w.category, PlanWarning) and "exceeds" in str(w.message)]) == said
