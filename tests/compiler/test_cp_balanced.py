"""Context parallelism with Llama 3's causal load balancing (``cp_balanced``, ``hybrid_cp_balanced`` in
:mod:`nnscaler.policies.context`): the balanced layout (``D1z``: rank r holds chunks r and 2W-1-r of
2W), its conversions, the causal work it balances, and the masked fixtures (sliding window, packed
documents: ``tests/fixtures/cp_masks.py``) trained against one device; wrong variants (mutants in
``tests/mutants/catalog/context.py``) caught and localised."""
from __future__ import annotations


import pytest
import torch

import opzoo  # noqa: F401
from nnscaler.comm.conversion import layout_steps
from nnscaler.config import PlanError
from nnscaler.dimops.layout import Replicate, Shard, balanced_order, join_blocks, shard_indices
from nnscaler.dimops.partition import Partition
from nnscaler.policies import POLICIES, ComputeConfig
from tests.fixtures.cp_runs import MASKS as FIXTURE, check_masked, masked_graph, run_mutated


@pytest.fixture(scope="module")
def graphs():
    return {b: masked_graph(b) for b in ("build_window", "build_packed")}


@pytest.mark.parametrize("n, blocks", [(2, 1), (4, 1), (2, 3)])
def test_a_balanced_shard_holds_chunks_r_and_2w_minus_1_minus_r_and_joins_back(n, blocks):
    length = 2 * n * blocks * 3
    x = torch.arange(length)
    size = length // blocks
    for r in range(n):
        want = [b * size + p * (size // (2 * n)) + i for b in range(blocks) for p in (r, 2 * n - 1 - r)
                for i in range(size // (2 * n))]
        assert shard_indices(length, n, r, blocks, True) == want
    # the runtime's order (to_balanced, then a plain split in blocks) hands each rank the same pieces
    order = torch.tensor(balanced_order(length, n, blocks))
    plain = x[order].unflatten(0, (blocks, -1)).chunk(n, dim=1)
    assert [p.flatten().tolist() for p in plain] == [shard_indices(length, n, r, blocks, True) for r in range(n)]
    parts = [x[shard_indices(length, n, r, blocks, True)] for r in range(n)]
    assert torch.equal(join_blocks(parts, 0, blocks, True), x)
    assert not torch.equal(join_blocks(parts, 0, blocks), x)  # the plain join is not the sequence


def test_balanced_layouts_and_partitions_print_and_parse():
    assert str(Shard(1, 1, True)) == "D1z" and Shard.parse("D2/3z") == Shard(2, 3, True)
    p = Partition.parse("s=4z,h=2", 8)
    assert p.balanced == ("s",) and p.label == "s=4z,h=2"


def test_conversions_reach_a_balanced_shard_by_a_balanced_split_and_leave_it_by_a_gather():
    (step,), _ = layout_steps((Replicate(),), (Shard(1, 1, True),), (4,), 3, (2, 16, 8), True)
    assert (step.kind, step.balanced) == ("split", True)
    assert step.code("x", "g") == "C.split(C.to_balanced(x, 1, g), 1, g)"
    (step,), _ = layout_steps((Shard(1, 1, True),), (Replicate(),), (4,), 3, (2, 16, 8), True)
    assert step.code("x", "g") == "C.from_balanced(C.all_gather(x, 1, g), 1, g)"
    steps, _ = layout_steps((Shard(1, 1, True),), (Shard(1),), (4,), 3, (2, 16, 8), True)
    assert [s.kind for s in steps] == ["all_gather", "split"]  # never a plain split of balanced pieces
    with pytest.raises(ValueError, match="no conversion"):  # 16 tokens are not 2 x 16 pieces
        layout_steps((Replicate(),), (Shard(1, 1, True),), (16,), 3, (2, 16, 8), True)


@pytest.mark.parametrize("src, dst, mesh, shape, ids", [
    ("R", "D1z", (2,), (2, 8, 3), [None]),            # split into the balanced pair, backward gathers back
    ("D1z", "R", (4,), (2, 16, 3), ["s"]),            # keys for split queries: all_gather_sum_grad, back in order
    ("D1z", "R", (2,), (2, 8, 3), [None]),            # a plain gather back into sequence order
    ("V", "D1z", (2,), (2, 8, 3), [None]),            # reduce-scatter into the pair
    ("D1z", "D2", (2,), (2, 8, 4), [None]),           # balanced pieces are left by a gather only
    ("D0xD1z", "D0xR", (2, 2), (2, 8, 3), [None, "s"]),  # hybrid_cp_balanced's keys
    ("RxR", "D0xD1z", (2, 2), (2, 8, 3), [None, None]),
    ("R", "D1/2z", (2,), (2, 16, 3), [None]),         # balanced within each of two blocks
])
def test_balanced_conversions_give_the_right_pieces_on_ranks(gang, src, dst, mesh, shape, ids):
    """The generated expressions (``C.split(C.to_balanced(...))`` ...) run on real ranks: each rank's
    result is its balanced piece of the whole tensor forward, and of the whole gradient backward."""
    import math
    job = {"kind": "conversion", "mesh": list(mesh), "shape": list(shape), "src": src, "dst": dst,
           "ids": ids, "grad": True, "seed": 5}
    for a in gang.run(job, math.prod(mesh), timeout_s=60):
        assert a.failure is None and "error" not in a.result, (a.failure, a.result)
        assert a.result["problems"] == [], (src, dst, a.result["steps"], a.result["problems"])


def _attention_rows(graph, policy: str, world: int):
    """Per cp rank, the query rows its attention holds (the plan's layout of the scores' queries)."""
    plan = POLICIES[policy](graph, ComputeConfig(world))
    op = next(op for op in graph.ops if op.overload == "aten.scaled_dot_product_attention.default")
    q = op.layout(plan.partition(op)).inputs[0][-1]  # the cp axis
    assert isinstance(q, Shard) and q.dim == 2 and q.balanced == policy.endswith("balanced"), q
    s = op.inputs[0].shape[2]
    return [shard_indices(s, plan.mesh_shape[-1], r, q.blocks, q.balanced) for r in range(plan.mesh_shape[-1])]


@pytest.mark.parametrize("world", [2, 4])
def test_balanced_cp_evens_the_causal_work_where_contiguous_cp_does_not(graphs, world):
    """Unmasked score elements per rank under the layouts the plans give the attention's queries:
    causal, exactly even balanced where contiguous cp's last rank does (W-1) (S/W)^2 more than its
    first; the fixture's sliding window, within one chunk's worth (a chunk of rows, WINDOW keys each)
    under both."""
    from tests.fixtures.cp_masks import WINDOW, window_mask
    g = graphs["build_window"]
    s = g.inputs[0].shape[1]
    chunk = s // (2 * world)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    work = {p: [int(causal[rows].sum()) for rows in _attention_rows(g, p, world)] for p in ("cp", "cp_balanced")}
    assert sum(work["cp"]) == sum(work["cp_balanced"]) == int(causal.sum())
    assert len(set(work["cp_balanced"])) == 1, work
    assert max(work["cp"]) - min(work["cp"]) == (world - 1) * (s // world) ** 2, work
    window = window_mask(s)
    for p in ("cp", "cp_balanced"):
        done = [int(window[rows].sum()) for rows in _attention_rows(g, p, world)]
        assert sum(done) == int(window.sum()) and max(done) - min(done) <= chunk * WINDOW, (p, done)


def test_cp_balanced_marks_every_sequence_split_and_keeps_keys_whole(graphs):
    g = graphs["build_packed"]
    plan = POLICIES["cp_balanced"](g, ComputeConfig(4))
    assert plan.policy == "cp_balanced" and plan.mesh_shape == (4,)
    split = [op for op in g.ops if plan.partition(op).splits and plan.partition(op).splits[0][0] is not None]
    assert split and all(plan.partition(op).balanced == (plan.partition(op).splits[0][0],) for op in split)
    for op in (op for op in g.ops if op.overload == "aten.matmul.default"):
        lay = op.layout(plan.partition(op))
        assert str(lay.inputs[0][0]) == "D2z" and str(lay.inputs[1][0]) == "R", (op.name, lay)
    hybrid = POLICIES["hybrid_cp_balanced"](g, ComputeConfig(4))
    assert hybrid.mesh_shape == (2, 2) and hybrid.axis_names == ("dp", "cp")
    op = next(op for op in g.ops if op.overload == "aten.matmul.default")
    assert [str(q) for q in op.layout(hybrid.partition(op)).inputs[0]] == ["D0", "D2z"]


def test_cp_balanced_refuses_a_sequence_without_two_chunks_per_rank(graphs):
    with pytest.raises(PlanError, match="does not divide into 32 chunks"):
        POLICIES["cp_balanced"](graphs["build_window"], ComputeConfig(16))


@pytest.mark.slow
@pytest.mark.parametrize("builder", ["build_window", "build_packed"])
def test_masked_models_train_like_one_device_under_balanced_cp(verify_model, builder):
    check_masked(verify_model, builder, ["cp", "cp_balanced", "hybrid_cp_balanced"], (2, 4))


def _mutated(name: str, builder: str, tmp_path):
    return run_mutated(name, f"{FIXTURE}:{builder}", "cp_balanced", 2, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("mutant, builder, first", [
    # rotary tables computed whole cut in contiguous chunks while the tokens are balanced
    # (masks and rotary tables are built per chunk from the positions: the cut is on the positions, arange)
    ("cp_balanced_positions_contiguous", "build_window", "arange R -> D0z for unsqueeze input 0"),
    # the sliding-window mask's rows not shifted per chunk: every chunk gets the first chunk's rows
    ("cp_window_mask_not_shifted", "build_window", "split(axis 0, dims 0, balanced)"),
    # gathered keys/values left in the ranks' order: key columns out of line with mask and positions
    ("cp_balanced_keys_out_of_order", "build_window", "all_gather_sum_grad(axis 0, dims 2, balanced)"),
])
def test_a_wrong_balanced_program_is_caught_and_localised(mutant, builder, first, tmp_path):
    out = _mutated(mutant, builder, tmp_path)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "MISMATCH" in out.stdout and "first divergent conversion: " in out.stdout, out.stdout[-3000:]
    assert first in out.stdout, out.stdout[-3000:]


def test_state_read_by_tokens_is_stored_whole_under_balanced_cp_and_cut_on_use(graphs):
    """The learned positions (1, S, D) are read by the add that splits the tokens: ``cp`` stores its
    contiguous chunk, ``cp_balanced`` the whole table (a balanced pair is no range to store), cut to
    the rank's pair by the conversion on use."""
    from nnscaler.codegen.emit import generate, stored_layouts
    g = graphs["build_window"]
    pos = next(t for t in g.params if tuple(t.shape) == (1, 16, 32))
    lay = {p: stored_layouts(g, POLICIES[p](g, ComputeConfig(2)))[pos] for p in ("cp", "cp_balanced")}
    assert (str(lay["cp"][0]), str(lay["cp_balanced"][0])) == ("D1", "R"), lay
    src = generate(g, POLICIES["cp_balanced"](g, ComputeConfig(2)), 0)[0]
    assert "C.split(C.to_balanced(p['pos'], 1, g[0]), 1, g[0])" in src


@pytest.mark.parametrize("policy, world", [("cp", 2), ("cp_balanced", 4), ("hybrid_cp_balanced", 4), ("cp_ring_balanced", 4),
                                           ("cp_tp", 4)])
def test_masks_are_built_per_chunk_from_the_positions(policy, world):
    """Causal, sliding-window and packed-document masks (and rotary tables) are built by each rank for its own
    rows (``nnscaler/policies/masks.py``): no conversion cuts a tensor with two sequence-long dims (O(S^2) built
    whole, as before); the cut is on the positions (O(S)). Without the pass the masks are cut whole."""
    from nnscaler.codegen.emit import emit_program
    from nnscaler.compile.plan import choose_plan
    from verify.models.registry import MODELS
    import verify.models.hf  # noqa: F401
    from tests.fixtures.cp_runs import traced
    for name, graph in (("window", masked_graph("build_window")), ("packed", masked_graph("build_packed")),
                        ("llama", traced(MODELS["llama"](0)))):
        seq = next(t for t in graph.inputs if len(t.shape) > 1).shape[1]

        def square_cuts(plan, g):
            return [t.name for t, _, step in emit_program(g, plan, 0).steps
                    if step.kind == "split" and sum(n == seq for n in t.shape) >= 2]

        g = graph.copy()
        assert not square_cuts(choose_plan(g, policy, ComputeConfig(world)), g), (name, policy)
        import nnscaler.policies.builtin as B
        import nnscaler.policies.cp_mesh as M
        kept = (B.rows_per_chunk, M.rows_per_chunk)
        try:  # the greedy's plan without the pass cuts the masks whole: the assertion above can fail
            B.rows_per_chunk = M.rows_per_chunk = lambda graph, plan, axis: plan
            g = graph.copy()
            assert square_cuts(POLICIES[policy](g, ComputeConfig(world)), g), (name, policy)
        finally:
            B.rows_per_chunk, M.rows_per_chunk = kept
