"""What the real-size memory measurement found in the program (``bench/results/real_memory.md``), each fixed and
held here: the compiled module keeps none of the model's own weights (the traced program's state dict held the
whole unsharded model on every rank), ZeRO 3's buckets keep Llama's final norm apart from its embedding, the
measurement does not count ZeRO's ``.grad`` placeholders, and the cluster estimate counts what bf16-mixed keeps
in fp32."""
from __future__ import annotations

import gc
import tempfile
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from nnscaler import ComputeConfig
from nnscaler.runtime.module import block_of

SEQ = 32


def _llama():
    from bench.calibration.fake_stage import Chunk, llama_config
    return Chunk(llama_config("llama3-8b", SEQ, 2, 128), True, True)


def _compile(model, zero=3):
    import opzoo  # noqa: F401
    from nnscaler.compile.parallelize import parallelize
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return parallelize(model, (ids, ids), "dp", ComputeConfig(1, runtime_ngpus=2, zero=zero,
                                                                    precision="bf16-mixed"), gen_savedir=d, verify=False)


@pytest.fixture
def fake_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_compiled_module_keeps_no_weight_of_the_model(fake_group):
    model = _llama()
    storages = [weakref.ref(p.untyped_storage()) for p in model.parameters()]
    pm = _compile(model)
    del model
    gc.collect()
    alive = [s for s in storages if s() is not None]
    assert not alive, f"{len(alive)} of the model's weight storages outlive it (held by the compiled module)"
    assert all(t.device.type == "meta" for t in pm.graph.exported.state_dict.values())


def test_the_final_norm_has_a_zero3_bucket_of_its_own(fake_group):
    assert block_of("model.embed_tokens.weight") != block_of("model.norm.weight")
    assert block_of("model.layers.3.mlp.up_proj.weight") == block_of("model.layers.3.input_layernorm.weight")
    pm = _compile(_llama())
    names = {id(p): n for n, p in pm.named_parameters()}
    for b in pm._zero.buckets:
        held = {names.get(id(p), "") for p in b.params}
        assert not (any("embed_tokens" in n for n in held) and any("norm" in n for n in held)), held


def test_the_measurement_does_not_count_grad_placeholders():
    from bench.calibration.fake_stage import tracker_class
    from nnscaler.runtime.shard_grad import ShardGrad
    p = torch.nn.Parameter(torch.zeros(256, 256))
    tracker = tracker_class()()
    with tracker:
        g = ShardGrad(p, lambda: [], 3)
        tracker._update_and_maybe_create_winfos(g, "Gradient")
        real = torch.ones(256, 256)
    total = tracker.get_tracker_snapshot()[torch.device("cpu")]["Total"]
    assert total == real.untyped_storage().nbytes()  # the placeholder's 256 KiB not counted
    del g, real


def _meta_llama_shape():
    """Llama-3 8B's widths, 2 blocks, at ``SEQ`` tokens, traced on meta tensors into the planner's block shape."""
    import opzoo  # noqa: F401
    from nnscaler.cluster.trace import trace_shape
    from bench.calibration.fake_stage import llama_config
    from transformers import LlamaForCausalLM
    from verify.models.common import LossOf
    with torch.device("meta"):
        model = LossOf(LlamaForCausalLM(llama_config("llama3-8b", SEQ, 2, 128)))
        ids = torch.zeros(1, SEQ, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shape = trace_shape(model, (ids, ids))
    return shape


def test_bf16_mixed_keeps_the_residual_stream_in_fp32():
    """The block reader marks what autocast keeps in fp32 (norm inputs, the residual) and not what a bf16
    operator saves (a linear's input is its bf16 cast); the estimate counts the former at 4 bytes."""
    from nnscaler.cluster.memory import section_saved
    shape = _meta_llama_shape()
    ops = shape.block.ops
    assert sum(o.saved_fp32 + o.saved_whole_fp32 for o in ops) > 0
    assert all(o.saved_fp32 + o.saved_whole_fp32 == 0 for o in ops if o.kind == "linear")
    assert sum(o.saved_gathered for o in ops) > 0  # autocast's bf16 copies of the normed input (q, k, v, gate, up)
    plain = section_saved(shape.block, 1, False, 1.0, 2)
    mixed = section_saved(shape.block, 1, False, 1.0, 2, fp32_bytes=4)
    assert mixed > 1.1 * plain


def test_the_mask_bias_is_counted_for_torchs_attention_and_not_for_the_ring():
    """torch's attention with an explicit mask keeps a bias of it per call (per layer); context parallelism's
    ring (nnscaler/runtime/ring.py) reads the model's mask as it is: the same plan under the ring scheme saves
    ``layers x mask_bias`` fewer bytes, and nothing else differs."""
    import dataclasses
    from nnscaler.cluster.cost import Parallel, estimate
    from nnscaler.profiles import PROFILES
    shape = _meta_llama_shape()
    bias = [o.mask_bias for o in shape.block.ops if o.mask_bias]
    assert len(bias) == 1 and bias[0] == SEQ * SEQ  # the one attention's (1, 1, seq, seq) mask
    par = Parallel(tp=2, dp=2, cp=2, micro_batch_size=1, num_microbatches=2, sequence_parallel=True, zero=1,
                   recompute="none", cp_scheme="allgather")
    gathered = estimate(shape, par, PROFILES["h100"], "bf16-mixed", 4)
    ring = estimate(shape, dataclasses.replace(par, cp_scheme="ring"), PROFILES["h100"], "bf16-mixed", 4)
    per_rank = shape.layers * SEQ * SEQ / par.cp * 2  # bf16 bytes, one micro-batch in flight
    assert gathered.memory["activations"] - ring.memory["activations"] == pytest.approx(per_rank, rel=1e-6)
