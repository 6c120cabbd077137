"""The pipeline memory the cluster estimate counts, held to what the runtime runs (``bench/results/real_memory.md``):
the real-size measurement drives torch's interleaved 1F1B order, the estimate's micro-batches in flight are that
schedule's, and torch's ``PipelineStage`` (what ``nnscaler/runtime/pipeline.py`` builds) allocates a receive buffer of
the stage's input and of its output's gradient for every micro-batch of the step, which
``nnscaler.cluster.memory.stage_boundaries`` counts."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
from torch.distributed.pipelining._utils import InferenceMode
from torch.distributed.pipelining.schedules import _ComputationType
from torch.testing._internal.distributed.fake_pg import FakeStore

from bench.calibration.fake_stage import schedule
from nnscaler.cluster.memory import in_flight, saved_in_flight, stage_boundaries


@pytest.fixture
def fake_pp():
    def init(pp: int, rank: int):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pp)
    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def _stages(pp: int, rank: int, v: int):
    x = torch.zeros(2, 4).requires_grad_()  # as the runtime's stage metadata: a floating tensor carries a gradient
    return [PipelineStage(torch.nn.Linear(4, 4), rank + c * pp, pp * v, torch.device("cpu"), input_args=(x,),
                          output_args=(x,), group=dist.group.WORLD) for c in range(v)]


def _torch_order(pp: int, rank: int, v: int, m: int) -> list[tuple[str, int, int]]:
    """Rank ``rank``'s forwards and backwards as torch's ``ScheduleInterleaved1F1B`` orders them."""
    kinds = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
    order = ScheduleInterleaved1F1B(_stages(pp, rank, v), m).pipeline_order[rank]
    return [(kinds[a.computation_type], a.stage_index // pp, a.microbatch_index) for a in order
            if a is not None and a.computation_type in kinds]


@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (3, 2, 6)])
def test_the_measurement_runs_torchs_interleaved_order(fake_pp, pp, v, m):
    for rank in range(pp):
        fake_pp(pp, rank)
        assert schedule(pp, rank, v, m) == _torch_order(pp, rank, v, m), (pp, rank, v, m)


def _most_in_flight(ops) -> int:
    alive = most = 0
    for kind, _, _ in ops:
        alive += 1 if kind == "F" else -1
        most = max(most, alive)
    return most


@pytest.mark.parametrize("pp,v,m", [(4, 1, 8), (4, 1, 2), (4, 2, 8), (4, 4, 4), (8, 4, 16), (8, 8, 8), (16, 4, 32)])
def test_the_estimate_holds_the_schedules_micro_batches_in_flight(pp, v, m):
    for s in range(pp):
        assert in_flight(pp, s, m, v) * v == _most_in_flight(schedule(pp, s, v, m)), (pp, s, v, m)


@pytest.mark.parametrize("pp,v,m", [(4, 1, 8), (4, 2, 8), (4, 4, 4), (8, 4, 16), (9, 6, 18), (16, 4, 32)])
def test_the_estimate_holds_each_chunks_forwards_in_flight(pp, v, m):
    """A stage's chunks hold unequal blocks where the layers do not divide evenly (Megatron-Core's GPT 177B, 96 blocks
    over pp 9 x v 6: chunks of 1 and 2), and the warm-up runs the early chunks' forwards more often than the late ones':
    the most saved at once is the schedule's, chunk by chunk, not the stage's blocks times its micro-batches in flight
    (which read 0.90 of that stage's saved activations at real width on fake tensors, bench/results/real_memory.md)."""
    for s in range(pp):
        for weights in ([1.0] * v, [2.0] * (v - 1) + [1.0], [1.0] + [2.0] * (v - 1), [float(c + 1) for c in range(v)]):
            alive, most = [0] * v, 0.0
            for kind, c, _ in schedule(pp, s, v, m):
                alive[c] += 1 if kind == "F" else -1
                most = max(most, sum(n * w for n, w in zip(alive, weights)))
            assert saved_in_flight(pp, s, m, v, weights) == most, (pp, s, v, m, weights)
        assert saved_in_flight(pp, s, m, v, [1.0] * v) == in_flight(pp, s, m, v) * v


def test_torchs_stage_keeps_a_receive_buffer_per_micro_batch(fake_pp):
    """A middle stage of three: one buffer of its input and one of its output's gradient for each of the step's
    micro-batches, allocated before the first runs (what the estimate counts; a runtime that allocated them per
    micro-batch in flight would fail here, and ``stage_boundaries`` should then count less)."""
    fake_pp(3, 1)
    m = 5
    stage = _stages(3, 1, 1)[0]
    stage._inference_mode = InferenceMode.STATIC  # what the schedule's first step settles: the runtime gives every
    # stage its input and output metadata (nnscaler/runtime/pipeline.py)
    stage._prepare_forward_infra(m, (torch.zeros(2, 4),), {}, has_backward=True)
    stage._prepare_backward_infra(m)
    inputs = {id(i.buffer) for infos in stage.args_recv_info.values() for i in infos if i.buffer is not None}
    grads = {id(i.buffer) for infos in stage.grad_recv_info.values() for i in infos if i.buffer is not None}
    assert len(inputs) == m and len(grads) == m
    whole = 1.0
    # the first stage receives no input, the last no gradient; every other both, for each of the m micro-batches
    assert stage_boundaries(3, 1, m, 1, whole) >= 2 * m * whole
    assert stage_boundaries(3, 0, m, 1, whole) < stage_boundaries(3, 1, m, 1, whole)
    assert stage_boundaries(1, 0, m, 1, whole) == 0


def test_the_estimate_holds_the_receive_buffers_of_every_micro_batch():
    """A pipelined plan's peak grows with the step's micro-batches by the receive buffers (inputs and output
    gradients, whole fp32 under bf16-mixed) beyond the in-flight peak."""
    from nnscaler.cluster.cost import Parallel, estimate
    from nnscaler.profiles import get_profile
    from tests.fixtures.llama_meta import meta_shape
    shape = meta_shape(256, 896, 256, 1024)
    h100 = get_profile("h100")

    def peak(**kw):
        return estimate(shape, Parallel(**kw), h100, "bf16-mixed", 64).memory

    whole = shape.seq * shape.hidden * 4
    a, b = peak(pp=4, dp=2, num_microbatches=8), peak(pp=4, dp=2, num_microbatches=16)
    # stage 0 of four receives no input: 8 more gradient buffers, and the input gradients it keeps are none
    assert b["peak"] - a["peak"] == pytest.approx(8 * whole, rel=0.02)
    assert a["buffers"] >= stage_boundaries(4, 0, 8, 1, whole)
    assert peak(pp=1, dp=8, num_microbatches=8)["buffers"] < a["buffers"] - 8 * whole  # no pipeline, no boundary


@pytest.mark.parametrize("tp, zero, saved_gib", [(4, 2, 15.5), (8, 1, 12.0)])
def test_the_estimate_holds_the_saved_activations_measured_on_the_405b_plans(tp, zero, saved_gib):
    """Stage 0 of the 405B plans (seq 8192, pp 8 v 8, 8 micro-batches, full recompute) measured at real width on fake
    tensors (bench/results/real_memory.md: 15.5 and 12.0 GiB saved): the estimate counts each chunk forward's causal
    mask and rotary tables, the embedding's whole fp32 output per micro-batch, and no first block input apart from
    the chunk's boundary (0.92 and 0.71 of the measured before those terms)."""
    from bench.calibration.llama_models import llama_shape
    from nnscaler.cluster.cost import Parallel, estimate
    from nnscaler.profiles import get_profile
    par = Parallel(tp=tp, sequence_parallel=True, pp=8, virtual_stages=8, dp=256, num_microbatches=8, zero=zero,
                   recompute="full")
    got = estimate(llama_shape("llama3-405b", 8192), par, get_profile("h100"), "bf16-mixed", 2048).memory
    assert got["activations"] / 2**30 == pytest.approx(saved_gib, rel=0.05)


@pytest.mark.slow  # traces Llama-3 405B on meta at seq 131072
def test_the_estimate_holds_a_middle_stage_fuller_than_the_first():
    """Llama-3 405B at seq 131072, tp 8 + sp, pp 32 (4 blocks on the middle stages, 3 on the first), 2 micro-batches,
    no recompute, measured at real width on fake tensors (bench/results/real_memory.md): a middle stage saved 516.5 GiB,
    the first and the last less; the estimate took only the first and the last stage's moments (437.8 GiB, 0.85)."""
    from bench.calibration.llama_models import llama_shape
    from nnscaler.cluster.cost import Parallel, estimate
    from nnscaler.profiles import get_profile
    par = Parallel(tp=8, sequence_parallel=True, pp=32, dp=64, num_microbatches=2, zero=1, recompute="none")
    got = estimate(llama_shape("llama3-405b", 131072), par, get_profile("h100"), "bf16-mixed", 128).memory
    assert got["activations"] / 2**30 == pytest.approx(516.5, rel=0.10)
