"""The cluster cost model's terms fitted or set on the stacks of published runs (nnscaler/cluster/published_runs.csv): ZeRO-3
overlap inside a node and across nodes (a part of its own traffic), attention efficiency by call size (measured kernels); and, off for the code nnscaler emits, torchtitan's per-op selective activation
checkpointing (``sac_alternate_linears``) and bf16 parameters without autocast's per-micro-batch weight copies
(``weight_casts``); on a small Llama traced on meta."""
from __future__ import annotations

import dataclasses

import pytest

from nnscaler.cluster.cost import Parallel, estimate, sac_recomputed
from nnscaler.profiles import get_profile

from tests.fixtures.llama_meta import meta_shape

H100 = get_profile("h100")


def with_constants(**kw):
    return dataclasses.replace(H100, cluster=dataclasses.replace(H100.cluster, **kw))


@pytest.fixture(scope="module")
def shape():
    pytest.importorskip("transformers")
    return meta_shape(2048, 5632, 2048, 32000)


def est(shape, profile, **kw):
    par = Parallel(**{"dp": 8, "zero": 3, **kw})
    return estimate(shape, par, profile, "bf16-mixed", global_batch=8)


def test_torchtitan_recomputes_every_second_linear_and_the_memory_bound_operators(shape):
    again = sac_recomputed(shape.block)
    linears = [o for o in shape.block.ops if o.kind == "linear"]
    assert [o for o in again.ops if o.kind == "linear"] == linears[1::2]  # k_proj, o_proj, up_proj
    assert [o.gemm[2] for o in linears[1::2]] == [512, 2048, 5632]  # (kv 4 heads x 128, hidden, ffn)
    assert not any(o.kind == "attention" for o in again.ops)  # the attention kernel's output is saved
    assert {id(o) for o in shape.block.ops if o.kind == "memory"} <= {id(o) for o in again.ops}


def test_the_saved_set_sets_what_selective_recompute_costs(shape):
    megatron = est(shape, H100, recompute="selective")
    titan = est(shape, with_constants(sac_alternate_linears=True), recompute="selective")
    full = est(shape, H100, recompute="full")
    assert megatron.time["recompute"] < titan.time["recompute"] < full.time["recompute"]
    # about a third of the block's linear FLOPs again (k, o, up of q k v o gate up down) and every norm and activation:
    # at this small width (hidden 2048) the memory-bound operators weigh most
    assert 0.3 < titan.time["recompute"] / full.time["recompute"] < 0.9
    none = est(shape, with_constants(sac_alternate_linears=True), recompute="none")
    assert none.time["recompute"] == 0.0 and none.step_seconds == est(shape, H100, recompute="none").step_seconds


def test_bf16_parameters_keep_no_weight_copies_per_micro_batch(shape):
    cast = est(shape, H100, recompute="none", micro_batch_size=1, num_microbatches=4)
    kept = est(shape, with_constants(weight_casts=False), recompute="none", micro_batch_size=1, num_microbatches=4)
    copies = shape.layers * shape.block.params(1) * 2  # every block's bf16 weights, one micro-batch in flight
    # the flag is our runtime's autocast: its weight copies, and the fp32 tensors it saves at 4 bytes
    # (nnscaler.cluster.cost._micro_batch), none of which a stack computing with bf16 parameters keeps
    assert cast.memory["activations"] - kept.memory["activations"] > copies
    assert cast.step_seconds == kept.step_seconds  # a memory term only
    full = est(shape, H100, recompute="full")  # recomputed blocks keep no copies either way
    assert full.memory["activations"] < cast.memory["activations"]


def test_zero3_hides_behind_compute_by_where_its_group_runs(shape):
    """``zero3_overlap`` inside a node, ``zero3_overlap_across`` for a group that leaves it (None: the same)."""
    inside = with_constants(zero3_overlap=0.0, zero3_overlap_across=0.9)
    same = with_constants(zero3_overlap=0.0)
    one_node = [est(shape, p, dp=8, micro_batch_size=1, num_microbatches=4).time["dp_comm"] for p in (inside, same)]
    assert one_node[0] == one_node[1] > 0  # 8 ranks on one node of 8: zero3_overlap alone
    par = Parallel(dp=16, zero=3, micro_batch_size=1, num_microbatches=4)
    two = [estimate(shape, par, p, "bf16-mixed", global_batch=64).time["dp_comm"] for p in (same, inside)]
    assert two[0] > two[1] >= 0.0  # 16 ranks on two nodes of 8: the group leaves its node


def test_zero3_hides_a_part_of_its_own_traffic_at_most_the_compute(shape):
    """``zero3_overlap`` is the part of ZeRO-3's gathers and reduce-scatters hidden, not a part of the step: with
    0.5 half the traffic stays exposed however long the compute, and no more than the compute can be hidden."""
    par = Parallel(dp=16, zero=3, micro_batch_size=1, num_microbatches=4)
    bare = estimate(shape, par, with_constants(zero3_overlap_across=0.0), "bf16-mixed", global_batch=64)
    half = estimate(shape, par, with_constants(zero3_overlap_across=0.5), "bf16-mixed", global_batch=64)
    assert half.time["dp_comm"] == pytest.approx(0.5 * bare.time["dp_comm"])
    compute = bare.time["total"] - bare.time["dp_comm"] - bare.time["optimizer"]
    slow = dataclasses.replace(with_constants(zero3_overlap_across=1.0), inter_beta=H100.inter_beta / 1000)
    capped = estimate(shape, par, slow, "bf16-mixed", global_batch=64)
    raw = estimate(shape, par, dataclasses.replace(slow, cluster=dataclasses.replace(slow.cluster,
                   zero3_overlap_across=0.0)), "bf16-mixed", global_batch=64).time["dp_comm"]
    assert capped.time["dp_comm"] == pytest.approx(raw - compute, rel=1e-6)  # all of the compute hides, no more


def test_attention_runs_faster_on_bigger_calls_as_measured():
    """The attention curve (``attention_efficiency``) fitted to the measured H100 flash attention: within 12% of every
    measured call where one constant was off by up to 143%, and at its plateau for a 128k-token rank's call."""
    from bench.calibration import kernel_fit
    rows = kernel_fit.load()
    c = kernel_fit.fit(H100.cluster, rows)
    attn = [r for r in rows if r["kind"] == "attention" and r["op"] == "sdpa_fwd_bwd"]
    errs = [abs(e) for e in kernel_fit.log_errors(c, attn)]
    flat = [abs(e) for e in kernel_fit.log_errors(dataclasses.replace(c, attention_half=0.0), attn)]
    assert max(errs) < 0.12 < max(flat)
    small, large = c.attention_efficiency(3.4e10), c.attention_efficiency(8.8e12)
    assert small < 0.5 * large and large == pytest.approx(c.attention, rel=0.01)
    assert H100.cluster.attention_half == pytest.approx(c.attention_half, rel=0.05)  # CALIBRATED holds the fit
