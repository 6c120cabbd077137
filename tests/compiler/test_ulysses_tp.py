"""Ulysses under tp (``cp_tp_ulysses`` in :mod:`nnscaler.policies.cp_mesh`): dp x tp x cp, attention's heads cut
on tp and, inside each tp rank's heads, on cp (one identifier split on two mesh axes, nested), reached by one
all-to-all on the cp axis each way. Proven on transformers' Llama against one device (float32, bf16-mixed,
ZeRO and recompute), refused by name where a tp rank's heads do not divide by cp, and a wrong variant (the
all-to-all over the tp group, ``tests/mutants/catalog/context.py``) caught and localised. ``pp2_cp_tp_ulysses``
runs it in each of two pipeline stages (W=4: pp2 x cp2 Ulysses)."""
from __future__ import annotations

import pytest

from nnscaler.config import PlanError
from nnscaler.policies import ComputeConfig
from nnscaler.policies.cp_mesh import attention_core, cp_tp_ulysses
from nnscaler.policies.pipeline import pipeline_config, stage_config
from tests.fixtures.cp_runs import run_mutated, traced
from verify.judge.verdict import MATCH

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_graph():
    from verify.models.registry import MODELS
    import verify.models.hf  # noqa: F401
    return traced(MODELS["llama"](0))


def test_attention_splits_its_heads_on_tp_then_on_cp_and_is_reached_by_one_all_to_all(llama_graph):
    from nnscaler.comm.conversion import conversion
    from nnscaler.dimops.partition import repeated
    plan = cp_tp_ulysses(llama_graph, ComputeConfig(4, tp_size=2))
    assert (plan.mesh_shape, plan.axis_names) == ((2, 2), ("tp", "cp"))  # cp innermost: nested inside tp's heads
    core = attention_core(llama_graph)
    matmuls = [op for op in llama_graph.ops if op.name in core and op.overload == "aten.matmul.default"]
    assert len(matmuls) == 4  # q k^T and p v in each of two layers
    for op in matmuls:
        p = plan.partition(op)
        heads = op.bound.inputs[0][1][0]
        assert p.splits == ((heads, 2), (heads, 2)) and repeated(p) == {heads}, (op.name, p)
        lay = op.layout(p)
        assert [str(q) for q in lay.inputs[0]] == ["D1", "D1"], (op.name, lay.inputs[0])
    q_k = matmuls[0]  # queries arrive split by sequence on cp, heads on tp: one all-to-all on the cp axis
    x = q_k.inputs[0]
    src = plan.partition(x.producer) and x.producer.layout(plan.partition(x.producer)).outputs[0]
    steps, _ = conversion(src, q_k.layout(plan.partition(q_k)).inputs[0], plan.partition(q_k).axis_ids,
                          plan.mesh_shape, x.shape, True)
    assert [(s.kind, s.axis) for s in steps] == [("all_to_all", 1)], steps
    for op in llama_graph.ops:  # outside attention nothing splits an identifier twice
        if op.known and op.name not in core:
            assert not repeated(plan.partition(op)) or op.overload == "aten._assert_tensor_metadata.default", op.name


def test_heads_of_a_tp_rank_that_do_not_divide_by_cp_are_refused_by_name(llama_graph):
    with pytest.raises(PlanError, match=r"cp_tp_ulysses: attention operator \S+ cannot split its heads over "
                                        r"tp x cp = 2 x 4 ranks.*must divide by cp=4"):
        cp_tp_ulysses(llama_graph, ComputeConfig(8, tp_size=2))


@pytest.mark.slow
@pytest.mark.parametrize("fields", [{}, {"precision": "bf16-mixed", "zero": 1, "recompute": "full"}])
def test_llama_trains_like_one_device_under_ulysses_with_tp(verify_model, fields):
    rows = verify_model("llama", policies=["cp_tp_ulysses"], world_sizes=(4,), steps=2, **fields)
    assert [r.status for r in rows] == [MATCH], [(r.status, r.detail) for r in rows]


@pytest.mark.slow
def test_an_all_to_all_over_the_wrong_group_is_caught_and_localised(tmp_path):
    out = run_mutated("ulysses_all_to_all_wrong_group", "llama", "cp_tp_ulysses", 4, tmp_path)
    assert out.returncode == 1 and "MISMATCH" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert "first divergent conversion: " in out.stdout and "for matmul input 0" in out.stdout, out.stdout[-3000:]
    assert "all_to_all(axis 1, dims 2,1)" in out.stdout, out.stdout[-3000:]


@pytest.mark.parametrize("world, mesh", [(4, ((2,), ("cp",))), (8, ((2, 2), ("tp", "cp")))])
def test_each_pipeline_stage_is_ulysses_on_its_own_ranks(llama_graph, world, mesh):
    policy, config = pipeline_config("pp2_cp_tp_ulysses", ComputeConfig(world))
    assert (policy, config.pp_size) == ("cp_tp_ulysses", 2)
    plan = cp_tp_ulysses(llama_graph, stage_config(config))
    assert (plan.mesh_shape, plan.axis_names) == mesh


@pytest.mark.slow
@pytest.mark.parametrize("fields", [{}, {"precision": "bf16-mixed", "recompute": "full"}])
def test_llama_trains_like_one_device_under_pipelined_ulysses(verify_model, fields):
    rows = verify_model("llama", policies=["pp2_cp_tp_ulysses"], world_sizes=(4,), steps=2, **fields)
    assert [r.status for r in rows] == [MATCH], [(r.status, r.detail) for r in rows]
