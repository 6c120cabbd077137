"""The cluster planner: the recipe-aware cost breakdown, the joint search and its constraints, on a small
Llama traced once on the meta device (no weights allocated)."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from nnscaler import ComputeConfig, PlanError
from nnscaler.cluster.cost import Parallel, bubble_fraction, estimate, layer_split
from nnscaler.cluster.memory import in_flight
from nnscaler.profiles import get_profile
from nnscaler.cluster.search import plan_cluster, search, trace_shape

from tests.fixtures.llama_meta import meta_shape

H100 = get_profile("h100")


@pytest.fixture(scope="module")
def shape():
    pytest.importorskip("transformers")
    return meta_shape(2048, 5632, 2048, 32000)


def est(shape, **kw):
    par = Parallel(**{"dp": 8, **kw})
    return estimate(shape, par, H100, "bf16-mixed", global_batch=par.dp * par.micro_batch_size * par.num_microbatches)


def test_repeated_blocks_are_read_once(shape):
    assert shape.layers == 8 and shape.heads == 16 and shape.kv_heads == 4 and shape.hidden == 2048
    assert shape.causal
    linears = [o for o in shape.block.ops if o.kind == "linear"]
    assert [o.column for o in linears] == [True, True, True, False, True, True, False]  # q k v | o, gate up | down
    assert sum(o.tp_collectives for o in shape.block.ops) == 2  # Megatron: two all-reduces forward per block
    assert sum(o.tp_bwd_collectives for o in shape.block.ops) == 2  # and two backward
    # every parameter counted once: blocks x block + outside
    assert shape.layers * shape.block.params(1) + shape.pre.params(1) + shape.post.params(1) == shape.params


def test_zero_stages_shard_state_over_dp(shape):
    m0, m1, m2, m3 = (est(shape, zero=z).memory for z in range(4))
    assert m1["optimizer"] == pytest.approx(m0["optimizer"] / 8)
    assert m1["grads"] == m0["grads"] and m2["grads"] == pytest.approx(m0["grads"] / 8)
    assert m3["params"] == pytest.approx(m0["params"] / 8) and m2["params"] == m0["params"]
    # bf16-mixed: fp32 master weights and gradients, two fp32 AdamW states
    assert m0["optimizer"] == pytest.approx(2 * m0["params"])


def test_recompute_cuts_activations_and_costs_time(shape):
    none, sel, full = (est(shape, recompute=r) for r in ("none", "selective", "full"))
    assert full.memory["activations"] < sel.memory["activations"] < none.memory["activations"]
    assert none.time["recompute"] == 0 < sel.time["recompute"] < full.time["recompute"]
    assert full.step_seconds > none.step_seconds


def test_tensor_and_sequence_parallelism(shape):
    tp1, tp4, sp4 = est(shape, dp=2), est(shape, dp=2, tp=4), est(shape, dp=2, tp=4, sequence_parallel=True)
    assert tp4.memory["params"] < 0.3 * tp1.memory["params"]
    assert sp4.memory["activations"] < tp4.memory["activations"] < tp1.memory["activations"]
    assert tp4.time["tp_comm"] > 0 == tp1.time["tp_comm"]


def test_tp_comm_overlap_hides_all_but_one_chunk_only_when_the_stack_overlaps(shape):
    # Megatron-Core's --tp-comm-overlap (its published rows): the sp collectives pipelined with the GEMMs in tp chunks
    import dataclasses
    assert H100.cluster.tp_comm_overlap is False  # off for plans: the code nnscaler emits does not overlap them
    over = dataclasses.replace(H100, cluster=dataclasses.replace(H100.cluster, tp_comm_overlap=True))

    def pair(**kw):
        par = Parallel(**{"dp": 2, **kw})
        return [estimate(shape, par, prof, "bf16-mixed", global_batch=2) for prof in (H100, over)]
    off, on = pair(tp=4, sequence_parallel=True)
    assert on.time["tp_comm"] == pytest.approx(off.time["tp_comm"] / 4) and on.step_seconds < off.step_seconds
    for kw in ({"tp": 1}, {"tp": 4}):  # tp 1, or tp without sequence parallelism: nothing changes
        off, on = pair(**kw)
        assert on.time == off.time


def test_a_hidden_data_parallel_collective_slows_the_compute_it_overlaps(shape):
    # ZeRO 0-2: the part of the dp collectives hidden behind compute costs overlap_slowdown of its time (the compute
    # shares the SMs with it); ZeRO 3's fitted overlap nets that out already: unchanged
    import dataclasses
    from nnscaler.profiles import OVERLAP_SLOWDOWN
    assert H100.cluster.overlap_slowdown == OVERLAP_SLOWDOWN == pytest.approx(0.189)
    free = dataclasses.replace(H100, cluster=dataclasses.replace(H100.cluster, overlap_slowdown=0.0))
    bare = dataclasses.replace(H100, cluster=dataclasses.replace(H100.cluster, overlap_slowdown=0.0, dp_overlap=0.0))
    for zero in (0, 1, 2):
        par = Parallel(dp=64, zero=zero, micro_batch_size=2, num_microbatches=2)
        paid, hid, raw = (estimate(shape, par, p, "bf16-mixed", global_batch=256) for p in (H100, free, bare))
        hidden = raw.time["dp_comm"] - hid.time["dp_comm"]  # what dp_overlap hides of the collectives
        assert hidden > 0
        assert paid.time["dp_comm"] == pytest.approx(hid.time["dp_comm"] + OVERLAP_SLOWDOWN * hidden)
        assert paid.step_seconds > hid.step_seconds
    z3 = Parallel(dp=64, zero=3, micro_batch_size=2, num_microbatches=2)
    assert estimate(shape, z3, H100, "bf16-mixed", 256).time == estimate(shape, z3, free, "bf16-mixed", 256).time


def test_cpu_gloo_plans_clusters_and_pays_for_sequence_parallelism(shape):
    # the cpu-gloo profile plans clusters too; its sequence-parallel collectives cost more than the all-reduces
    cpu = get_profile("cpu-gloo")
    assert cpu.cluster is not None and cpu.cluster.sp_comm > 1 == H100.cluster.sp_comm
    tp, sp = (estimate(shape, Parallel(tp=2, sequence_parallel=s), cpu, "32-true", 1) for s in (False, True))
    assert sp.time["tp_comm"] == pytest.approx(cpu.cluster.sp_comm * tp.time["tp_comm"])
    assert search(shape, ComputeConfig(2, profile="cpu-gloo", global_batch=2)).parallel.world == 2


def test_pipeline_bubble_and_in_flight(shape):
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, v=2) == pytest.approx(1.5 / 9.5)
    assert [in_flight(4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight(4, 0, 2) == 2  # never more than the micro-batches there are
    e = est(shape, dp=2, pp=4, num_microbatches=8)
    t = e.time
    assert t["bubble"] / (t["total"] - t["optimizer"] - t["dp_comm"] - t["pp_comm"]) == pytest.approx(3 / 11, rel=1e-6)
    assert est(shape, dp=2, pp=4, num_microbatches=8, virtual_stages=2).time["bubble"] < t["bubble"]
    counts, _ = layer_split(8, 4, 0.0, 0.0, 1.0)
    assert counts == [2, 2, 2, 2]
    counts, _ = layer_split(8, 4, 0.0, 3.0, 1.0)  # a heavy head: the last stage takes fewer blocks
    assert counts[-1] == 1 and sum(counts) == 8


def _split_by_scan(layers: int, stages: int, pre: float, post: float, per_layer: float) -> tuple[list[int], float]:
    """layer_split as it was: every candidate value of the slowest stage sorted, then bisected (L log L)."""
    if stages == 1:
        return [layers], pre + post + layers * per_layer
    eps = 1e-9

    def caps(t: float) -> tuple[int, int, int]:
        return (int((t - pre) / per_layer + eps), int((t - post) / per_layer + eps), int(t / per_layer + eps))

    def feasible(t: float) -> bool:
        a, b, c = caps(t)
        return a >= 1 and b >= 1 and (stages == 2 or c >= 1) and a + b + (stages - 2) * c >= layers

    cands = sorted({pre + a * per_layer for a in range(1, layers + 1)} | {post + b * per_layer for b in range(1, layers + 1)}
                   | {c * per_layer for c in range(1, layers + 1)})
    lo, hi = 0, len(cands) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(cands[mid]):
            hi = mid
        else:
            lo = mid + 1
    t = cands[lo]
    a, b, c = caps(t)
    first = max(1, min(a, layers - (stages - 1)))
    last = max(1, min(b, layers - first - (stages - 2)))
    rest = layers - first - last
    if stages == 2:
        return [first, last + rest], max(pre + first * per_layer, post + (last + rest) * per_layer)
    base, extra = divmod(rest, stages - 2)
    counts = [first] + [base + (1 if i < extra else 0) for i in range(stages - 2)] + [last]
    return counts, max(pre + first * per_layer, post + last * per_layer, max(counts[1:-1]) * per_layer)


def test_layer_split_finds_the_slowest_stage_the_full_scan_finds():
    import random
    rng = random.Random(0)
    for _ in range(400):
        layers = rng.randint(2, 130)
        stages = rng.randint(2, min(layers, 64))
        pre, post, t = rng.choice([0.0, rng.uniform(0, 5)]), rng.uniform(0, 8), rng.uniform(0.1, 2)
        assert layer_split(layers, stages, pre, post, t) == _split_by_scan(layers, stages, pre, post, t)


def test_a_search_memo_changes_no_estimate(shape):
    from nnscaler.cluster.search import candidates
    memo: dict = {}
    for par in list(candidates(shape, 16, 32, {}, 8))[::7]:
        a = estimate(shape, par, H100, "bf16-mixed", 32, None, 4, memo)
        b = estimate(shape, par, H100, "bf16-mixed", 32)
        assert a.time == b.time and a.memory == b.memory, par
    assert memo  # and it was used

def test_fixing_every_key_evaluates_exactly_that_configuration(shape):
    from nnscaler.config import CONSTRAINT_KEYS
    cons = {"tp": 2, "pp": 2, "dp": 2, "micro_batch_size": 1, "num_microbatches": 4, "virtual_stages": 2,
            "recompute": "full", "zero": 1, "sequence_parallel": True, "cp": 1, "cp_scheme": "allgather",
            "cp_balanced": True}
    assert set(cons) == set(CONSTRAINT_KEYS)
    plan = search(shape, ComputeConfig(8, profile="h100", precision="bf16-mixed", global_batch=8, constraints=cons))
    assert plan.considered == 1
    assert {k: plan.summary()["parallel"][k] for k in cons} == cons
    assert plan.summary()["parallel"]["schedule"] == "Interleaved1F1B"


def test_search_never_loses_to_a_fixed_configuration(shape):
    cfg = dict(profile="h100", precision="bf16-mixed", global_batch=64)
    free = search(shape, ComputeConfig(16, **cfg))
    fixed = search(shape, ComputeConfig(16, constraints={"tp": 4, "pp": 2, "recompute": "full"}, **cfg))
    assert free.best.step_seconds <= fixed.best.step_seconds
    assert fixed.parallel.tp == 4 and fixed.parallel.pp == 2 and fixed.parallel.recompute == "full"
    s = free.summary()
    assert 0 < s["mfu"] < 1
    assert set(s["step_time"]) >= {"compute", "recompute", "tp_comm", "pp_comm", "dp_comm", "bubble", "optimizer",
                                   "total"}
    assert set(s["memory_per_rank"]) >= {"params", "grads", "optimizer", "activations", "buffers", "peak"}
    assert s["memory_per_rank"]["peak"] <= s["memory_budget"]


@pytest.mark.parametrize("cons, words", [
    ({"tp": 3}, "nearest feasible tp: 2 or 4"),
    ({"pp": 16}, "nearest feasible pp: 8"),
    ({"dp": 5}, "nearest feasible dp: 4"),
    ({"virtual_stages": 16, "pp": 2}, "nearest feasible virtual_stages: 4"),
])
def test_infeasible_constraints_name_the_nearest_feasible_value(shape, cons, words):
    with pytest.raises(PlanError, match=words):
        search(shape, ComputeConfig(16, profile="h100", precision="bf16-mixed", global_batch=64, constraints=cons))


def test_a_model_that_cannot_fit_says_so(shape):
    with pytest.raises(PlanError, match="cannot fit .* smallest reachable"):
        search(shape, ComputeConfig(8, profile="h100", precision="bf16-mixed", global_batch=8, mem_budget=2**28))


def test_bad_input_is_one_line():
    with pytest.raises(PlanError, match="unknown constraint 'tpp'; valid: tp, pp"):
        ComputeConfig(8, constraints={"tpp": 2})
    with pytest.raises(PlanError, match="recompute='some'"):
        ComputeConfig(8, constraints={"recompute": "some"})
    with pytest.raises(PlanError, match="known: .*h100"):
        ComputeConfig(8, profile="h1000")


def test_plan_cluster_end_to_end_and_save(tmp_path):
    pytest.importorskip("transformers")
    import opzoo  # noqa: F401
    from transformers import LlamaConfig, LlamaForCausalLM
    from verify.models.common import LossOf
    with torch.device("meta"):
        m = LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                                         attn_implementation="sdpa", use_cache=False))
        ids = torch.zeros(1, 256, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_cluster(LossOf(m), (ids, ids), ComputeConfig(16, profile="a100", precision="bf16-mixed",
                                                                  global_batch=32))
    path = plan.save(tmp_path / "plan.json")
    data = json.loads(path.read_text())
    assert data["parallel"] == plan.summary()["parallel"] and data["world_size"] == 16
    assert "MFU" in plan.one_line()


def test_published_runs_cite_their_sources():
    import csv
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "nnscaler" / "cluster" / "published_runs.csv").read_text()
    comments = "\n".join(ln for ln in text.splitlines() if ln.startswith("#"))
    rows = list(csv.DictReader(ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")))
    assert len(rows) >= 30
    for r in rows:
        assert f"[{r['source']}]" in comments, r["name"]
        assert r["metric"] in ("tokens_per_gpu", "tflops_per_gpu", "tflops_per_gpu_recompute",
                               "tflops_per_gpu_causal") and float(r["value"]) > 0
        assert r["kernels"] in ("eager", "fused") and r["device"] in ("a100", "h100")
        assert r["attention"] in ("flash", "materialized")


def test_saved_activations_per_block_are_what_autograd_saves():
    """The block's saved-activation estimate against autograd's own saved tensors in one eager forward (a
    multi-head Llama: grouped-query attention is expanded in the traced program but not in eager sdpa). A
    product with a tensor that needs no gradient (rotary ``q * cos``) keeps only that tensor: counting ``q``
    too made the estimate 19% high."""
    pytest.importorskip("transformers")
    import opzoo  # noqa: F401
    from transformers import LlamaConfig, LlamaForCausalLM
    from nnscaler.cluster.memory import section_saved
    from verify.cases.memory import SavedActivations
    from verify.models.common import LossOf
    torch.manual_seed(0)
    m = LossOf(LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                                            attn_implementation="sdpa", use_cache=False)))
    ids = torch.randint(0, 512, (2, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shape = trace_shape(m, (ids, ids))
    layer, saved = m.model.model.layers[1], SavedActivations(m.parameters())
    layer.register_forward_pre_hook(lambda mod, args: (saved.__enter__(), None)[1])  # a hook's result replaces args
    layer.register_forward_hook(lambda mod, args, out: (saved.__exit__(None, None, None), None)[1])
    m(ids, ids)
    est = section_saved(shape.block, 1, False, 1.0, 4)
    assert est == pytest.approx(saved.bytes, rel=0.02)  # all but sdpa's log-sum-exp
