"""The real-size memory measurement (``bench/calibration/real_memory.py``) at a reduced size: its fake
tensors measure what real ones do, the planner's state bytes hold against it, and a wrong estimate is
caught by the comparison."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from bench.calibration.fake_stage import llama_config, measure_stage, measured
from bench.calibration.real_memory import compare, estimated, worst
from nnscaler import ComputeConfig
from nnscaler.cluster.cost import Parallel

SEQ, BLOCKS, NARROW = 128, 2, 16  # Llama-3 8B's widths / 16, 2 blocks
STATE = ("params", "grads", "optimizer")


@pytest.fixture(scope="module")
def small_plan():
    """A cluster plan of a narrow Llama on 8 ranks (tp 2 x dp 4, ZeRO 1, sequence parallel), measured."""
    import opzoo  # noqa: F401
    from transformers import LlamaForCausalLM

    from verify.models.common import LossOf
    with torch.device("meta"):
        model = LossOf(LlamaForCausalLM(llama_config("llama3-8b", SEQ, BLOCKS, NARROW)))
        ids = torch.zeros(1, SEQ, dtype=torch.long)
    return _measured_plan(model, ids, {"tp": 2, "pp": 1, "dp": 4, "num_microbatches": 2}, NARROW, "llama3-8b")


def _measured_plan(model, ids, layout: dict, scale: int, name: str):
    """``model`` planned on 8 ranks under ``layout`` (mbs 1, sequence parallel, ZeRO 1, no recompute), measured."""
    from nnscaler.cluster.search import plan_cluster
    cons = {"micro_batch_size": 1, "virtual_stages": 1, "sequence_parallel": True, "zero": 1, "recompute": "none",
            **layout}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_cluster(model, (ids, ids), ComputeConfig(8, profile="h100", precision="bf16-mixed", global_batch=8,
                                                              constraints=cons))
        return plan, measured(plan, width_scale=scale, name=name)


@pytest.mark.slow  # ~15-30 s: two compiles and steps, fake and real
def test_fake_tensors_measure_what_real_ones_hold():
    par = Parallel(tp=2, dp=4, micro_batch_size=1, num_microbatches=1, sequence_parallel=True, zero=3,
                   recompute="full")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fake = measure_stage("llama3-8b", par, "bf16-mixed", SEQ, 0, BLOCKS, 1, NARROW, fake=True)
        real = measure_stage("llama3-8b", par, "bf16-mixed", SEQ, 0, BLOCKS, 1, NARROW, fake=False)
    for key in ("params", "grads", "optimizer", "activations", "peak"):
        assert fake[key] == real[key] > 0, key


def test_state_estimate_holds_on_the_small_plan(small_plan):
    plan, got = small_plan
    ratio = compare(got, estimated(plan))
    for key in STATE:  # activations and peak: see bench/results/real_memory.md (the estimate is short of both)
        assert abs(ratio[key] - 1) <= 0.10, (key, ratio)


def test_a_wrong_estimate_is_caught(small_plan):
    plan, got = small_plan
    right = estimated(plan)
    tp = plan.parallel.tp
    for key in ("params", "activations"):  # as if tensor parallelism did not split it
        wrong = {**right, key: right[key] * tp}
        assert abs(compare(got, wrong)[key] - compare(got, right)[key]) >= 0.5 * compare(got, right)[key]
    off = lambda est: max(abs(est[k] / got[k] - 1) for k in STATE)  # noqa: E731
    assert off({**right, "params": right["params"] * tp}) > 0.10 >= off(right)
    assert worst(got, {**right, "activations": right["activations"] * tp}) > 0.10
    # a wrong parallel configuration (no tensor parallelism) is as far off
    other = dataclasses.replace(plan.parallel, tp=1, dp=8, sequence_parallel=False)
    from nnscaler.cluster.cost import estimate
    from nnscaler.profiles import get_profile
    e = estimate(plan.shape, other, get_profile("h100"), plan.precision, plan.global_batch)
    assert abs(got["params"] / e.memory["params"] - 1) > 0.10


def test_a_plan_over_the_device_is_said_so(small_plan):
    """``bench/calibration/autodist.py --measure-memory`` prints this line under each cluster plan."""
    from bench.calibration.real_memory import device_line
    plan, got = small_plan
    assert device_line(plan, got).endswith(": fits"), device_line(plan, got)
    over = device_line(plan, {**got, "peak": plan.best.budget + 1})
    assert "OVER THE DEVICE" in over, over


def test_a_plan_over_the_device_is_said_so_whatever_its_search_budget(small_plan):
    """A published row's search is allowed the memory our estimate says that run took (``calibrate.row_search``:
    124 GiB a rank for Llama 3 405B on 80 GiB H100s): the device, not that budget, decides what fits."""
    from bench.calibration.real_memory import device_bytes, device_line, over_device
    plan, got = small_plan
    device = 0.9 * 80 * 2**30  # h100's usable part
    assert device_bytes(plan) == device and device_bytes(plan, 96) == 0.9 * 96 * 2**30
    raised = dataclasses.replace(plan, best=dataclasses.replace(plan.best, budget=2.0 ** 60))
    big = {**got, "peak": device + 2**30}
    assert over_device(raised, big) and "OVER THE DEVICE" in device_line(raised, big)
    assert not over_device(raised, big, memory_gib=96)  # the row's own 96 GiB device holds it
    assert device_line(raised, got).endswith(": fits")


def test_the_fullest_middle_stage_is_measured_where_it_holds_more():
    """The estimate's state is the most any stage holds (``memory.rank_memory``); the first and the last stage of a
    split that puts fewer blocks there (Llama-3 405B's 126 over pp 16: 7, 8 x 14, 7) hold less than a middle one."""
    from bench.calibration.fake_stage import stages_of
    assert stages_of([7] + [8] * 14 + [7], 16, 1) == [0, 15, 1]
    assert stages_of([8] * 14 + [7, 7], 16, 1) == [0, 15]  # the first holds as much as any
    assert stages_of([2, 2, 1, 2] + [2, 2, 2, 1], 4, 2) == [0, 3]  # per stage 4, 4, 3, 3
    assert stages_of([1, 2, 2, 1] + [1, 2, 1, 1], 4, 2) == [0, 3, 1]  # per stage 2, 4, 3, 2
    assert stages_of([80], 1, 1) == [0]
    # interleaved, every stage 8 blocks: stage 1's chunks of 3, 3, 2 hold the most forwards in flight (Megatron-Core's
    # GPT 314B over pp 12 x v 3; the first stage's 2, 3, 3 fewer), so it is measured too
    gpt314 = [2] + [3] * 24 + [2] * 11
    assert stages_of(gpt314, 12, 3) == [0, 11] and stages_of(gpt314, 12, 3, 24) == [0, 11, 1]


@pytest.mark.slow  # ~20-60 s: the 405B rows' searches
def test_the_published_rows_plans_are_all_built():
    """Every published row's plan is measured: a row whose published configuration fits only without the memory bound
    (Llama 3 405B: tp8 pp16 dp64 without recompute, over our 72 GiB estimate) is completed as the calibration does
    (``calibrate.row_plan``), not stopped in a ``PlanError``."""
    from bench.calibration.real_memory import plans
    names = ["search-llama3-405b-8k", "search-llama3-405b-16k"]
    got = {label: plan for label, plan, _ in plans(only=names)}
    assert sorted(got) == sorted(names) and all(p.parallel.cp == 1 for p in got.values())


def test_the_measurement_takes_the_stage_holding_the_most_blocks():
    """The estimate's parameters, gradients and optimizer state are the most any stage holds; where a middle stage
    holds more blocks than the first and the last (8 blocks over pp 5: 1, 2, 2, 2, 1), it is measured too (the 405B
    plans' parameters read 1.09 of the first and the last stage's when it was not)."""
    from bench.calibration.fake_stage import _counts, stages_measured
    from nnscaler.cluster.search import search
    from tests.fixtures.llama_meta import meta_shape
    shape = meta_shape(256, 896, 256, 1024)
    for pp in (1, 4, 5):
        plan = search(shape, ComputeConfig(2 * pp, profile="h100", precision="bf16-mixed", global_batch=16 * pp,
                                           constraints={"pp": pp, "tp": 1, "virtual_stages": 1, "cp": 1}), "x")
        blocks = _counts(plan)
        got = stages_measured(plan)
        assert got[:2] == [0, pp - 1][:min(pp, 2)], got
        assert max(blocks[s] for s in got) == max(blocks), (pp, blocks, got)


GPT, GPT_NARROW = "gpt-mc-1.7b", 8  # Megatron-Core's GPT 1.7B widths / 8 (heads 2: tp 2 splits its attention)


@pytest.fixture(scope="module")
def small_gpt_plan():
    """A pipelined cluster plan of a narrow GPT row model (``verify.models.nanogpt``, as the GPT rows' shapes are traced:
    ``bench/calibration/llama_models.py``) on 8 ranks (tp 2 x pp 2 x dp 2, ZeRO 1), measured stage by stage."""
    import opzoo  # noqa: F401

    from bench.calibration.fake_stage import gpt_config
    from verify.models.nanogpt import GPT as NanoGPT
    with torch.device("meta"):
        model = NanoGPT(gpt_config(GPT, SEQ, 4, GPT_NARROW))
        ids = torch.zeros(1, SEQ, dtype=torch.long)
    return _measured_plan(model, ids, {"tp": 2, "pp": 2, "dp": 2, "num_microbatches": 4}, GPT_NARROW, GPT)


def test_a_gpt_row_is_measured_on_the_gpt_its_shape_was_costed_on(small_gpt_plan):
    """The GPT rows (Megatron-LM SC'21, Megatron-Core, MPT) are measured on nanoGPT's GPT cut into chunks
    (``fake_stage.model_chunk``), not on a Llama of their widths, and the estimate holds on it: the state, and the
    saved activations (0.73 before the estimate counted the whole fused q, k, v projection the attention's three views
    keep, and the loss's fp32 cast of bf16 logits: ``nnscaler.cluster.blocks``)."""
    from bench.calibration.fake_stage import model_chunk
    plan, got = small_gpt_plan
    ratio = compare(got, estimated(plan))
    for key in STATE + ("activations",):
        assert abs(ratio[key] - 1) <= 0.05, (key, ratio)
    with torch.device("meta"):
        chunk = model_chunk(GPT, SEQ, 2, True, False, GPT_NARROW)[0]
        llama = model_chunk("llama3-8b", SEQ, 2, True, False, 16)[0]
    assert type(chunk).__name__ == "GPTChunk" and type(llama).__name__ == "Chunk"
    names = {n.split(".")[-2] for n, _ in chunk.named_parameters()}
    assert {"wte", "wpe", "c_attn", "c_fc"} <= names and "lm_head" not in names


@pytest.mark.slow  # ~30 s: two compiles and steps, fake and real
def test_fake_tensors_measure_what_real_ones_hold_on_a_gpt_stage():
    """A middle GPT stage (hidden states in and out, no embedding or head) under ZeRO 3 and full recompute."""
    par = Parallel(tp=2, pp=3, dp=2, micro_batch_size=1, num_microbatches=4, sequence_parallel=True, zero=3,
                   recompute="full")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fake = measure_stage(GPT, par, "bf16-mixed", SEQ, 1, BLOCKS, 4, GPT_NARROW, fake=True)
        real = measure_stage(GPT, par, "bf16-mixed", SEQ, 1, BLOCKS, 4, GPT_NARROW, fake=False)
    for key in ("params", "grads", "optimizer", "activations", "peak"):
        assert fake[key] == real[key] > 0, key


GQA = (512, 1536, 2, 8, 2, 1024)  # a narrow Llama with grouped-query attention: 8 heads of 64, 2 kv heads


def _block_saved(recompute: str, tp: int, name=GQA) -> tuple[float, float]:
    """(measured, estimated) bytes one block of ``name`` (``GQA``, or ``GPT`` at ``GPT_NARROW``) leaves saved per
    micro-batch on a rank of tp ``tp`` (sequence parallel): the measured stage with two blocks less the one with one."""
    import opzoo  # noqa: F401
    from transformers import LlamaForCausalLM

    from bench.calibration.fake_stage import gpt_config
    from nnscaler.cluster.cost import estimate
    from nnscaler.cluster.search import trace_shape
    from nnscaler.profiles import get_profile
    from verify.models.common import LossOf
    from verify.models.nanogpt import GPT as NanoGPT
    seq, width = 256, 1 if name == GQA else GPT_NARROW
    with torch.device("meta"):
        model = (LossOf(LlamaForCausalLM(llama_config(GQA, seq, 2))) if name == GQA
                 else NanoGPT(gpt_config(name, seq, 2, width)))
        ids = torch.zeros(1, seq, dtype=torch.long)
    par = Parallel(tp=tp, dp=2, micro_batch_size=1, num_microbatches=1, sequence_parallel=True, zero=2,
                   recompute=recompute)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        memo: dict = {}
        estimate(trace_shape(model, (ids, ids)), par, get_profile("h100"), "bf16-mixed", 2, memo=memo)
        one, two = (measure_stage(name, par, "bf16-mixed", seq, 0, [b], 1, width)["activations"] for b in (1, 2))
    return two - one, next(iter(memo.values()))["per_layer_act"]


@pytest.mark.parametrize("recompute,tp", [("full-except-core", 2), ("none", 2), ("full-except-core", 1)])
def test_repeated_kv_heads_are_saved_at_their_own_width_where_a_rank_holds_one(recompute, tp):
    """Grouped-query attention repeats the kv heads (``repeat_kv``: an expand, then a reshape); the reshape copies while
    a rank holds several kv heads and is a view of the one it holds otherwise (tp >= kv heads): v, bf16 from its
    projection, is then kept at its own head's width; k, cast from fp32 after the rotary under bf16-mixed, is copied
    whole by the cast. The estimate counted both at q's width: Llama-3 405B's tp8 plan with full-except-core read
    1.14 of its saved activations (one 32 MiB tensor a block over, measured at real width on fake tensors)."""
    got, est = _block_saved(recompute, tp)
    assert abs(est / got - 1) <= 0.02, (est / got, got, est)


@pytest.mark.parametrize("name", [GQA, GPT], ids=["gqa-llama", "gpt"])
def test_selective_recompute_keeps_its_regions_boundary(name):
    """Selective recompute checkpoints the attention module's operators that read no parameter
    (nnscaler/codegen/recompute.py): the checkpoint keeps the region's inputs (nanoGPT: the fused q, k, v projection q,
    k and v view; Llama: the q, k and v projections at their own widths, not repeated) and the out-projection keeps the
    region's output. The estimate dropped the core's saved tensors and counted nothing in their place: per block 0.876
    on the GPT, 0.955 on the GQA Llama (search-mc-gpt-119b, selective, read 0.88 of its saved activations at real width
    on fake tensors)."""
    got, est = _block_saved("selective", 2, name)
    assert abs(est / got - 1) <= 0.03, (est / got, got, est)


@pytest.mark.slow  # ~30-60 s: five narrow stages
def test_an_extrapolated_stage_keeps_which_chunks_hold_the_extra_blocks():
    """Interleaved, the warm-up runs the early chunks' forwards more often than the late ones' (pp 4, v 2, stage 0:
    chunk 0 up to 8 times, chunk 1 up to 4), so a stage of chunks 6 and 5 blocks saves more than one of 5.5 and 5.5:
    extrapolated from 2 and 4 blocks per chunk spread evenly it read 0.96 of its saved activations measured as it is."""
    from bench.calibration.fake_stage import measure_chunks
    par = Parallel(tp=1, pp=4, dp=1, micro_batch_size=1, num_microbatches=8, virtual_stages=2, zero=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = measure_chunks(GPT, par, "bf16-mixed", SEQ, 0, [6, 5], False, GPT_NARROW)
        got = measure_chunks(GPT, par, "bf16-mixed", SEQ, 0, [6, 5], True, GPT_NARROW)
    assert abs(got["activations"] / exact["activations"] - 1) <= 0.005, (got, exact)
