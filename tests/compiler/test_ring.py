"""Context parallelism by ring exchange (``cp_ring``, ``cp_ring_balanced``, ``cp_tp_ring``: :mod:`nnscaler.policies.ring`,
kernel :mod:`nnscaler.runtime.ring`): attention rebound to one ring operator whose queries, keys and values stay
split on the sequence; the kernel on real gloo ranks against one device (``tests/fixtures/ring_ranks.py``), three
wrong rings caught there and, as compiler mutants (``tests/mutants/catalog/ring.py``), caught and localised on
transformers' Llama; Llama and the masks fixtures (sliding window by sdpa, packed documents by matmul) trained
against one device."""
from __future__ import annotations


import pytest
import torch

import opzoo  # noqa: F401
from nnscaler.config import PlanError
from nnscaler.policies import ComputeConfig
from nnscaler.runtime import ring as R
from nnscaler.runtime.partitioned import ShardContext
from tests.fixtures.cp_runs import check_masked, masked_graph, run_mutated, traced as _trace
from verify.judge.verdict import MATCH

pytest.importorskip("transformers")



def _llama():
    from verify.models.registry import MODELS
    import verify.models.hf  # noqa: F401
    return _trace(MODELS["llama"](0))


def test_attention_is_rebound_to_the_ring_with_keys_split_on_the_sequence():
    from nnscaler.codegen.emit import emit_program
    from nnscaler.compile.plan import choose_plan
    graph = _llama()
    plan = choose_plan(graph, "cp_ring_balanced", ComputeConfig(2))
    rings = [op for op in graph.ops if op.overload == "ring.scaled_dot_product_attention"]
    assert len(rings) == 2 and plan.note == "cp_ring_balanced: 2 attention(s) on the ring", plan.note
    assert not [op for op in graph.ops if op.overload in ("aten.softmax.int", "aten.matmul.default")]
    for op in rings:  # q, k^T, v and the output on the balanced split of s; the mask's key columns whole
        assert op.spec.annotation == "b h s d^, b h d^ s, b h s e, b 1 s t^ -> b h s e"
        lay = op.layout(plan.partition(op))
        assert [str(q[0]) for q in lay.inputs] == ["D2z", "D3z", "D2z", "D2z"] and str(lay.outputs[0][0]) == "D2z"
    code = "\n".join(emit_program(graph, plan, 1).lines)
    assert code.count("nnscaler.runtime.ring.ring_attention(ShardContext(") == 2 and "balanced=('s',)" in code
    assert "mods=(('mul', 0.3535533905932738), ('add', 0)), keys_transposed=True" in code


def test_the_masks_fixtures_ring_both_attentions_and_a_model_without_attention_is_refused():
    from nnscaler.compile.plan import choose_plan
    from nnscaler.policies.ring import ring_sites
    for builder, mods in (("build_window", (("mul", 0.25), ("keep", 0))), ("build_packed", (("div", 4.0), ("fill", 0, float("-inf"))))):
        graph = masked_graph(builder)
        sites = ring_sites(graph)
        assert len(sites) == 2 and sites[0].spec.local.keywords["mods"] == mods, (builder, sites[0].spec.local.keywords)
    from verify.models.registry import MODELS
    mlp = _trace(MODELS["bucketed_mlp"](0))
    with pytest.raises(PlanError, match="cp_ring: no self-attention the ring kernel runs"):
        choose_plan(mlp, "cp_ring", ComputeConfig(2))


def test_causal_sdpa_splits_its_sequence_on_the_ring():
    """nanoGPT's ``sdpa(is_causal=True)`` (its annotation freezes the queries' sequence, so ``cp`` runs it whole):
    rebound with the causal mask by global positions, the queries' sequence split in the balanced order."""
    from nnscaler.compile.plan import choose_plan
    from verify.models.registry import MODELS
    graph = _trace(MODELS["nanogpt"](0))
    plan = choose_plan(graph, "cp_ring_balanced", ComputeConfig(2))
    rings = [op for op in graph.ops if op.overload == "ring.scaled_dot_product_attention"]
    assert len(rings) == 2 and all(plan.partition(op).label == "s=2z" for op in rings)
    assert rings[0].spec.local.keywords["mods"][1:] == (("causal",),)


@pytest.mark.slow
def test_nanogpt_trains_like_one_device_under_the_ring(verify_model):
    rows = verify_model("nanogpt", policies=["cp_ring_balanced"], world_sizes=(2,), steps=2)
    assert [r.status for r in rows] == [MATCH], [(r.status, r.detail) for r in rows]


class _Biased(torch.nn.Module):
    """Self-attention whose scores get an additive term: a learned bias (``learn``: a parameter through a
    ``2 *``) or a causal mask built from positions."""

    def __init__(self, learn: bool):
        super().__init__()
        self.learn, self.qkv = learn, torch.nn.Linear(8, 24)
        self.bias = torch.nn.Parameter(torch.zeros(1, 1, 8, 8))

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4).unbind(0)
        i = torch.arange(8)
        extra = 2 * self.bias if self.learn else torch.where(i[None, :] <= i[:, None], 0.0, float("-inf"))
        return ((q @ k.transpose(-1, -2) * 0.5 + extra).softmax(-1) @ v).sum()


def test_a_learned_score_bias_is_not_a_mask():
    """The kernel gives masks no gradient: a score term computed from a parameter keeps its attention
    (all-gathered), one built from positions is rebound to the ring."""
    from nnscaler.policies.ring import ring_sites
    from verify.models.registry import ModelCase
    for learn, rings in ((True, 0), (False, 1)):
        graph = _trace(ModelCase(_Biased(learn), lambda step: (torch.randn(2, 8, 8),)))
        assert len(ring_sites(graph)) == rings, learn


@pytest.mark.parametrize("kind", ["causal", "window", "documents", "additive"])
def test_the_kernel_unsplit_is_attention(kind):
    """One rank (no group): the ring kernel and its gradients equal softmax attention in float64."""
    from tests.fixtures.ring_ranks import B, D, H, N, masks
    mods, ms = masks(kind)
    g = torch.Generator().manual_seed(1)
    q, k, v, cot = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(4))
    a = [x.clone().requires_grad_() for x in (q, k, v)]
    b = [x.clone().requires_grad_() for x in (q, k, v)]
    y = R.ring_attention(ShardContext({"s": N}), *a, *ms, ident="s", mods=mods)
    ref = R.attention(*b, *ms, mods=mods)
    (y * cot).sum().backward()
    (ref * cot).sum().backward()
    assert (y - ref).abs().max() < 1e-12 and all((x.grad - z.grad).abs().max() < 1e-12 for x, z in zip(a, b))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_the_ring_on_gloo_ranks_equals_one_device(world):
    from tests.fixtures.ring_ranks import check
    worst = check(world)
    assert len(worst) == 16  # float32 / float64 x causal, window, documents, additive x contiguous / balanced
    for key, errs in worst.items():
        assert max(errs) < (2e-6 if "float32" in key else 1e-13), (key, errs)


@pytest.mark.slow
@pytest.mark.parametrize("mutant, caught", [
    ("no_return", (2, 3)),  # the keys' and values' gradients end one rank off: dk, dv wrong
    ("mask_offset", (1,)),  # every block reads the first chunk's mask columns: dq wrong (windows, documents, Llama's)
    ("merge_weights", (0, 1, 2)),  # the running output not rescaled: out, dq, dk wrong
])
def test_a_wrong_ring_is_caught_on_gloo_ranks(mutant, caught):
    from tests.fixtures.ring_ranks import check
    worst = check(2, mutant)
    if mutant == "mask_offset":  # a causal mask by positions has no mask tensor to misread
        assert max(worst["float64 causal balanced"]) < 1e-13
    for i in caught:
        assert max(e[i] for e in worst.values()) > 1e-2, (mutant, i, worst)


@pytest.mark.slow
def test_llama_trains_like_one_device_under_the_ring(verify_model):
    rows = verify_model("llama", policies=["cp_ring", "cp_ring_balanced"], world_sizes=(2, 4), steps=2)
    assert [r.status for r in rows] == [MATCH] * 4, [(r.status, r.detail) for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("builder", ["build_window", "build_packed"])
def test_masked_models_train_like_one_device_under_the_ring(verify_model, builder):
    check_masked(verify_model, builder, ["cp_ring_balanced"], (4,))


@pytest.mark.slow
@pytest.mark.parametrize("mutant, policy, first", [
    ("ring_kv_gradient_not_returned", "cp_ring", "first divergent operator: ring_attention_1"),
    ("ring_mask_ignores_chunk_offset", "cp_ring_balanced", "first divergent operator: ring_attention "),
    ("ring_merge_wrong_weights", "cp_ring", "first divergent operator: ring_attention "),
])
def test_a_wrong_ring_program_is_caught_and_localised(mutant, policy, first, tmp_path):
    out = run_mutated(mutant, "llama", policy, 2, tmp_path)
    assert out.returncode == 1 and "MISMATCH" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert first in out.stdout, out.stdout[-3000:]


def test_the_plan_report_lists_the_rings_sends():
    """The ring's key/value ``batch_isend_irecv`` (inside its kernel) in the plan's collectives: over W ranks, W-1
    sends of the rank's K and V forward per attention, W-1 of them and W of their gradients backward."""
    from nnscaler.compile.plan import attach_stats, choose_plan
    from nnscaler.cost.summary import collective_table
    for policy, world, kv_bytes in (("cp_ring", 2, 2 * 4 * 4 * 4 * 8 * 4), ("cp_ring_balanced", 4, 2 * 4 * 4 * 2 * 8 * 4)):
        graph = _llama()
        plan = attach_stats(choose_plan(graph, policy, ComputeConfig(world)), graph, ComputeConfig(world))
        table = collective_table(plan.stats)
        fwd, bwd = table["forward"]["send_recv"], table["backward"]["send_recv"]
        assert (fwd["count"], bwd["count"]) == (2 * (world - 1), 2 * (2 * world - 1)), (policy, table)
        assert fwd["bytes"] == 2 * (world - 1) * kv_bytes, (policy, fwd)  # K, V (repeated: 4 heads), s/W rows
        assert "send_recv" in plan.report() and f"(+{2 * (world - 1)} coupled) fwd" in plan.one_line()
    cp_plan = _llama()
    assert "send_recv" not in str(collective_table(attach_stats(choose_plan(cp_plan, "cp", ComputeConfig(2)), cp_plan,
                                                                ComputeConfig(2)).stats))  # all-gathers, no ring


def test_the_ring_keeps_the_models_mask_not_a_bias_per_call():
    """Under bf16 autocast the ring saves the boolean mask it was given (the same storage, for every layer
    that reads it), never a bf16 bias of it as torch's masked attention does: the memory estimate's
    ``OpFacts.mask_bias`` is not counted under the ring scheme (nnscaler/cluster/memory.py)."""
    from nnscaler.runtime.ring import Chunks, Ring, RingAttention
    n = 8
    q, k, v = (torch.randn(1, 2, n, 4, requires_grad=True) for _ in range(3))
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        out = RingAttention.apply(q, k, v, Ring(None), Chunks(1, n, False), (("mul", 0.5), ("keep", 0)), mask)
    square = [t for t in saved if t.shape[-2:] == (n, n)]
    assert square and all(t.dtype == torch.bool and t.data_ptr() == mask.data_ptr() for t in square)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_the_ring_keeps_its_queries_and_output_as_they_are():
    """Under bf16 autocast the ring keeps the bf16 queries it was given and the bf16 output it returned (the same
    storages, as a flash kernel does), not float32 copies: ``recompute="full-except-core"`` keeps a block's kernel
    inputs and output once (the memory estimate counts them once, nnscaler/cluster/memory.py)."""
    from nnscaler.runtime.ring import Chunks, Ring, RingAttention
    n = 8
    q, k, v = (torch.randn(1, 2, n, 4, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = RingAttention.apply(q, k, v, Ring(None), Chunks(1, n, False), (("mul", 0.5), ("causal",)))
    wide = [t for t in saved if t.shape == q.shape]
    assert {t.data_ptr() for t in wide} == {q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()}, \
        [(t.dtype, t.shape) for t in saved]
    assert all(t.dtype == torch.bfloat16 for t in wide)
    out.float().sum().backward()
    ref_q = q.detach().float().requires_grad_()
    ref = torch.nn.functional.scaled_dot_product_attention(ref_q, k.detach().float(), v.detach().float(), is_causal=True)
    ref.sum().backward()
    torch.testing.assert_close(q.grad.float(), ref_q.grad, atol=3e-2, rtol=3e-2)


def test_the_ring_casts_its_inputs_as_autocast_casts_attention():
    """Under bf16 autocast the attention the ring stands for gets bf16 q, k and v (sdpa is on autocast's
    lower-precision list) and returns bf16; the ring does the same, so it keeps bf16 q, k, v and output for
    backward (what the memory estimate counts), not the float32 q and k rotary hands it; outside autocast it keeps
    its inputs' dtype."""
    n = 8
    q, k, v = (torch.randn(1, 2, n, 4, requires_grad=True) for _ in range(3))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        y = R.ring_attention(ShardContext({"s": n}), q, k, v, ident="s", mods=(("mul", 0.5), ("causal",)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert y.dtype == ref.dtype == torch.bfloat16
    assert [t.dtype for t in saved if t.shape == q.shape] == [torch.bfloat16] * 4
    torch.testing.assert_close(y.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert R.ring_attention(ShardContext({"s": n}), q, k, v, ident="s", mods=(("causal",),)).dtype == torch.float32
