"""Context parallelism (``cp``, ``hybrid_cp`` in :mod:`nnscaler.policies.builtin`; ``cp_tp``, cp x tp, in
:mod:`nnscaler.policies.cp_mesh`): every operator that
carries the tokens' sequence splits it, attention reads keys and values all-gathered (their gradients
reduce-scattered back), the rotary tables and the causal mask are built whole from global positions
and cut to the rank's chunk. Proven on transformers' Llama against one device, and two wrong
variants of the exchanges (mutants in ``tests/mutants/catalog/context.py``) caught and localised."""
from __future__ import annotations


import pytest

import opzoo  # noqa: F401
from nnscaler.config import PlanError
from nnscaler.policies import ComputeConfig
from nnscaler.policies.builtin import batch_identifiers, cp, hybrid_cp
from tests.fixtures.cp_runs import run_mutated, traced
from verify.judge.verdict import MATCH

pytest.importorskip("transformers")


def _llama():
    from verify.models.registry import MODELS
    import verify.models.hf  # noqa: F401
    return traced(MODELS["llama"](0))


@pytest.fixture(scope="module")
def llama_graph():
    return _llama()


def _matmuls(graph):
    return [op for op in graph.ops if op.overload == "aten.matmul.default"]


@pytest.mark.parametrize("world", [2, 4])
def test_cp_splits_the_sequence_of_attention_and_keeps_parameters_whole(llama_graph, world):
    plan = cp(llama_graph, ComputeConfig(world))
    seq = batch_identifiers(llama_graph, 1)
    scores = _matmuls(llama_graph)
    assert len(scores) == 4  # q k^T and p v in each of two layers
    for op in scores:  # the queries' sequence split, the keys' (the second input) whole on every rank
        assert plan.partition(op).splits == ((seq[op.name], world),), (op.name, plan.partition(op))
        lay = op.layout(plan.partition(op))
        assert all(str(q) == "R" for q in lay.inputs[1]), (op.name, lay.inputs[1])
    for op in llama_graph.ops:  # no parameter is stored split: cp holds every weight whole
        lay = op.layout(plan.partition(op)) if op.known else None
        for x, want in zip(op.inputs, lay.inputs if lay else ()):
            if getattr(x, "kind", None) == "param" and want is not None:
                assert all(str(q) == "R" for q in want), (op.name, x.name, want)


def test_hybrid_cp_splits_batch_outside_and_sequence_inside(llama_graph):
    plan = hybrid_cp(llama_graph, ComputeConfig(4))
    assert plan.mesh_shape == (2, 2) and plan.axis_names == ("dp", "cp")
    batch, seq = batch_identifiers(llama_graph), batch_identifiers(llama_graph, 1)
    op = _matmuls(llama_graph)[0]
    assert plan.partition(op).splits == ((batch[op.name], 2), (seq[op.name], 2)), plan.partition(op)


def test_cp_refuses_a_sequence_that_does_not_divide(llama_graph):
    with pytest.raises(PlanError, match="sequence .* does not divide over 3 context-parallel ranks"):
        cp(llama_graph, ComputeConfig(3))


@pytest.mark.slow
def test_llama_trains_like_one_device_under_cp(verify_model):
    rows = verify_model("llama", policies=["cp", "hybrid_cp"], world_sizes=(2, 4), steps=2)
    assert [r.status for r in rows] == [MATCH] * 4, [(r.status, r.detail) for r in rows]


def _mutated(name: str, tmp_path, policy: str = "cp", world: int = 2):
    return run_mutated(name, "llama", policy, world, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("mutant, first", [
    # keys/values' gradient never summed back to their owner: the all-gather before p @ v is named
    ("cp_kv_gradient_not_reduced", "steps: all_gather_sum_grad(axis 0, dims 2);"),
    # rotary tables and the causal mask cut to chunk 0 on every rank: positions not shifted per chunk
    # (masks and rotary tables are built per chunk from the positions: the cut is on the positions)
    ("cp_positions_not_shifted", "unsqueeze R -> D1 for "),
])
def test_a_wrong_context_parallel_program_is_caught_and_localised(mutant, first, tmp_path):
    out = _mutated(mutant, tmp_path)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "MISMATCH" in out.stdout and "first divergent conversion: " in out.stdout, out.stdout[-3000:]
    assert first in out.stdout, out.stdout[-3000:]


def test_cp_tp_splits_heads_on_tp_and_the_sequence_on_cp(llama_graph):
    from nnscaler.policies.cp_mesh import cp_tp
    seq = batch_identifiers(llama_graph, 1)
    for cfg, mesh in [(ComputeConfig(4), ((2, 2), ("cp", "tp"))),
                      (ComputeConfig(8, tp_size=2, cp_size=2), ((2, 2, 2), ("dp", "cp", "tp")))]:
        plan = cp_tp(llama_graph, cfg)
        assert (plan.mesh_shape, plan.axis_names) == mesh
        for op in _matmuls(llama_graph):  # queries' sequence on cp, heads (dim 1 of b h s d) on tp
            ids = op.bound.inputs[0]
            assert plan.partition(op).splits[-2:] == ((seq[op.name], 2), (ids[1][0], 2)), (op.name, plan.partition(op))
            keys = op.layout(plan.partition(op)).inputs[1]  # whole on cp (all-gathered), split by heads on tp
            assert str(keys[-2]) == "R" and str(keys[-1]).startswith("D1"), (op.name, keys)
    with pytest.raises(PlanError, match="cp_size 3 x tp_size 2 does not divide plan_ngpus 8"):
        cp_tp(llama_graph, ComputeConfig(8, tp_size=2, cp_size=3))


@pytest.mark.slow
def test_llama_trains_like_one_device_under_cp_tp(verify_model):
    rows = verify_model("llama", policies=["cp_tp"], world_sizes=(4,), steps=2)
    assert [r.status for r in rows] == [MATCH], [(r.status, r.detail) for r in rows]


@pytest.mark.slow
def test_cp_tp_kv_gradient_summed_over_the_wrong_axis_is_caught_and_localised(tmp_path):
    out = _mutated("cp_tp_kv_gradient_wrong_axis", tmp_path, "cp_tp", 4)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "first divergent conversion: " in out.stdout, out.stdout[-3000:]
    assert "for matmul_3 input 1" in out.stdout and "all_gather_sum_grad(axis 0, dims 2)" in out.stdout, out.stdout[-3000:]


@pytest.mark.slow
def test_llama_trains_like_one_device_under_balanced_cp_tp(verify_model):
    rows = verify_model("llama", policies=["cp_tp_balanced"], world_sizes=(4,), steps=2)
    assert [r.status for r in rows] == [MATCH], [(r.status, r.detail) for r in rows]


def test_cp_tp_balanced_holds_the_balanced_pair_on_cp_and_heads_on_tp(llama_graph):
    from nnscaler.dimops.layout import Shard
    from nnscaler.policies.context import cp_tp_balanced
    plan = cp_tp_balanced(llama_graph, ComputeConfig(4))
    assert plan.policy == "cp_tp_balanced" and (plan.mesh_shape, plan.axis_names) == ((2, 2), ("cp", "tp"))
    for op in _matmuls(llama_graph):  # queries: the balanced pair on cp (D2z), heads on tp; keys whole on cp
        q, k = op.layout(plan.partition(op)).inputs[:2]
        assert isinstance(q[0], Shard) and q[0].balanced and q[0].dim == 2 and str(q[1]).startswith("D1"), (op.name, q)
        assert str(k[0]) == "R", (op.name, k)


@pytest.mark.slow
def test_balanced_order_ignored_inside_cp_tp_is_caught_and_localised(tmp_path):
    out = _mutated("cp_tp_balanced_order_ignored", tmp_path, "cp_tp_balanced", 4)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "first divergent conversion: input_ids RxR -> D1zxR for embedding input 1" in out.stdout, out.stdout[-3000:]
    assert "split(axis 0, dims 1, balanced)" in out.stdout, out.stdout[-3000:]


def test_ulysses_splits_heads_inside_attention_and_the_sequence_outside(llama_graph):
    from nnscaler.codegen.emit import conversion_steps
    from nnscaler.policies.cp_mesh import attention_core, ulysses
    plan = ulysses(llama_graph, ComputeConfig(2))
    seq, core = batch_identifiers(llama_graph, 1), attention_core(llama_graph)
    assert {op.name for op in _matmuls(llama_graph)} <= core  # q k^T and p v of both layers
    for op in llama_graph.ops:
        got = plan.partition(op).splits
        if op.name in core:  # heads (dim 1 of b h s d) on the cp axis
            assert got == ((op.bound.inputs[0][1][0], 2),), (op.name, got)
        elif got:  # outside attention: the sequence or nothing (as under cp)
            assert got[0][0] in (seq[op.name], None), (op.name, got)
    kinds = [st.kind for st, _ in conversion_steps(llama_graph, plan, 0)]
    assert kinds.count("all_to_all") >= 8 and "all_gather_sum_grad" not in kinds  # no key/value all-gather


def test_a_cp_checkpoint_resumes_under_dp_and_tp():
    """Every whole-model case reloads its checkpoint under another plan: a cp one under dp (the reload
    check) and tp on half the ranks (the resume), so the rows of cp_tp/ulysses above include both."""
    from verify.cases.model import reload_policies
    from verify.cases.resume import plan_b
    for policy in ("cp", "cp_tp", "ulysses"):
        assert reload_policies(policy)[0] == "dp" and plan_b(policy, 4) == ("tp", 2)


@pytest.mark.slow
def test_llama_trains_like_one_device_under_ulysses(verify_model):
    rows = verify_model("llama", policies=["ulysses"], world_sizes=(2,), steps=2)
    assert [r.status for r in rows] == [MATCH], [(r.status, r.detail) for r in rows]


def test_sequence_parallelism_under_cp_cuts_each_cp_chunk_again_on_tp(llama_graph):
    """cp_tp with sp: the norms (no weight matrix) split their sequence on cp and, nested inside each chunk, on tp
    (Megatron's sp under cp); the projections keep it on cp alone. Inside balanced chunks or Ulysses' heads that
    nested split has no layout: those policies refuse rather than run without sp (they once did, silently)."""
    from nnscaler.policies.context import cp_tp_balanced
    from nnscaler.policies.cp_mesh import cp_tp, cp_tp_ulysses
    from nnscaler.policies.ring import cp_tp_ring_balanced
    seq = batch_identifiers(llama_graph, 1)
    plan = cp_tp(llama_graph, ComputeConfig(4, tp_size=2, cp_size=2, sequence_parallel=True))
    norms = [op for op in llama_graph.ops if op.overload == "aten.pow.Tensor_Scalar"]
    assert norms and all(plan.partition(op).splits == ((seq[op.name], 2), (seq[op.name], 2)) for op in norms)
    for op in _matmuls(llama_graph):  # attention as without sp: queries' sequence on cp, heads on tp
        assert plan.partition(op).splits[0] == (seq[op.name], 2)
    plain = cp_tp(llama_graph, ComputeConfig(4, tp_size=2, cp_size=2))
    assert all(plain.partition(op).splits[1][0] != seq[op.name] for op in norms)
    for policy in (cp_tp_balanced, cp_tp_ring_balanced, cp_tp_ulysses):
        with pytest.raises(PlanError, match="sequence_parallel with cp_size 2 > 1 is not lowered"):
            policy(llama_graph, ComputeConfig(4, tp_size=2, cp_size=2, sequence_parallel=True))
