"""The rules that bring MoE, MLA and shared-layer models to Megatron's bar under ``tp`` and a router
with random jitter to one collective under ``dp`` (#41): a strided whole-dim slice splits by phase (GPT-OSS's
interleaved gate|up), random draws shaped like their input are drawn whole and sliced (PhiMoE's
sparsemixer), a weight matrix fed whole is split by columns before rows (DeepSeek's shared experts,
narrower than the hidden size), a bias picked per token stays whole (GPT-OSS's per-expert biases),
and a dtype check of a parameter no longer fixes how it is stored. Each is checked on the model that
showed it and held out on others of the zoo (tiny configs, W=2)."""
from __future__ import annotations

import pytest
import torch

from nnscaler.compile.plan import plan_graph
from nnscaler.config import ComputeConfig
from nnscaler.ir.graph import PARAM
from nnscaler.policies.tp_check import collectives, layer_runs, sharded_fraction
from nnscaler.runtime.partitioned import ShardContext
from opzoo import kernels as K
from opzoo.rulekit import INT_MAX, T, derive, make_call
from tests.conftest import zoo_graph

pytest.importorskip("transformers")


def _tp(arch: str, world: int = 2):
    graph = zoo_graph(arch)
    plan = plan_graph(graph, "tp", ComputeConfig(world))
    return graph, plan, sum(collectives(graph, plan, params=False)[0].values())


def test_a_strided_whole_dim_slice_splits_by_phase_and_others_stay_frozen():
    assert derive(make_call("aten.slice.Tensor", (T(2, 4, 12), -1, 1, INT_MAX, 2))).anno.text \
        == "a b (d 2), ?, ?, ?, ? -> a b d"
    spec = derive(make_call("aten.slice.Tensor", (T(6, 8), 0, 0, 6, 3)))
    assert spec.anno.text.startswith("(c 3) b") and spec.args[3] == INT_MAX  # an explicit end: to the local end
    for frozen in [(T(2, 12), 1, 2, INT_MAX, 2), (T(2, 7), 1, 0, INT_MAX, 2), (T(6, 8), 0, 1, 5, 2)]:
        assert "^" in derive(make_call("aten.slice.Tensor", frozen)).anno.text.split(",")[0], frozen
    x = torch.arange(24.0).reshape(2, 12)  # each rank's phase of its own block is its block of the whole's
    assert torch.equal(torch.cat([x[:, 6 * r:6 * r + 6][:, 1::2] for r in range(2)], 1), x[:, 1::2])


@pytest.mark.parametrize("op,args", [(torch.ops.aten.rand_like.default, ()), (torch.ops.aten.uniform.default, (0.9, 1.1)),
                                     (torch.ops.aten.exponential.default, ())])
def test_a_random_draw_is_drawn_whole_and_sliced_so_shards_hold_one_devices_numbers(op, args):
    name = str(op).replace("aten::", "aten.").replace(".default", "") + ".default"
    spec = derive(make_call(name, (T(4, 8), *args)))
    assert spec is not None and spec.local is not None and not spec.differentiable
    torch.manual_seed(3)
    whole = op(torch.empty(4, 8), *args)
    for r in range(2):
        torch.manual_seed(3)
        got = K.draw(ShardContext({"a": 4, "b": 8}, {"b": 2}, {"b": r}, {"b": None}), torch.empty(4, 4), *args,
                     fn=op, dims=("a", "b"))
        assert torch.equal(got, whole[:, 4 * r:4 * r + 4])


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3", "albert"])
def test_models_below_the_bar_now_meet_it(arch):
    graph, plan, fwd = _tp(arch)
    assert fwd <= 2 * layer_runs(graph) + 4, fwd
    assert sharded_fraction(graph, plan)[0] >= 0.75


@pytest.mark.slow
def test_held_out_moe_models_meet_the_bar():
    """Not tuned for: these were over the bar before the pairing and bias rules (10 for 2 layers)."""
    for arch in ("dots1", "glm4_moe", "deepseek_v2"):
        graph, plan, fwd = _tp(arch)
        assert fwd <= 2 * layer_runs(graph) + 4, (arch, fwd)


def test_a_weight_fed_whole_is_split_by_columns_not_rows():
    """A gated MLP narrower than its input (a shared expert): row-splitting gate and up slices the
    whole input for free but all-reduces both outputs, and a column-split down gathers its input and
    its output; Megatron's column-then-row pairs all-reduce once."""
    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(128)
            self.gate, self.up, self.down = torch.nn.Linear(128, 64), torch.nn.Linear(128, 64), torch.nn.Linear(64, 128)
            self.head = torch.nn.Linear(128, 8)

        def forward(self, x):
            h = self.norm(x)
            h = x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))
            return self.head(self.norm(h)).square().mean()
    from nnscaler.compile.plan import trace_model
    graph = trace_model(MLP(), (torch.randn(4, 8, 128),), None, registry=None, strict=False)
    plan = plan_graph(graph, "tp", ComputeConfig(2))
    parts = {op.name: plan.partition(op).axis_ids[0] for op in graph.ops if op.overload == "aten.linear.default"}
    lin = [n for n in parts]
    assert parts[lin[0]] == parts[lin[1]] == "n" and parts[lin[2]] == "k", parts  # column, column, row
    assert collectives(graph, plan, params=False)[0] == {"all_reduce": 1}, collectives(graph, plan)  # down's output


def test_a_per_token_bias_stays_whole_and_the_residual_stays_whole():
    graph, plan, _ = _tp("gpt_oss")
    picked = [op for op in graph.ops if op.overload == "aten.index.Tensor"
              and op.inputs[0].kind == PARAM and len(op.inputs[0].shape) == 2]
    assert picked and all(plan.partition(op).axis_ids == (None,) for op in picked)
    fwd = collectives(graph, plan, params=False)[0]
    assert not fwd.get("reduce_scatter"), fwd  # the experts' down projection is all-reduced, not scattered


def test_a_dtype_check_does_not_fix_a_routers_storage():
    """DeepSeek's router reads its weight through ``.type(float32)``: the check, planned first, stored
    the weight split and the router, kept whole, gathered it every step."""
    graph, plan, _ = _tp("deepseek_v3")
    fwd = collectives(graph, plan)[0]  # parameters included
    assert sum(fwd.values()) == sum(collectives(graph, plan, params=False)[0].values()), fwd


def test_dp_keeps_phimoe_s_jittered_router_data_parallel():
    graph = zoo_graph("phimoe")
    plan = plan_graph(graph, "dp", ComputeConfig(2))
    assert sum(collectives(graph, plan, params=False)[0].values()) == 1  # the loss alone
