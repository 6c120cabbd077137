"""The cluster planner traces two blocks and extends them to the real count: the same shape, estimates
and plan as tracing every block, and the whole trace where the short one would be wrong."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from nnscaler import ComputeConfig
from nnscaler.compile.plan import trace_model
from nnscaler.cluster.blocks import model_shape
from nnscaler.cluster.cost import Parallel, estimate
from nnscaler.profiles import get_profile
from nnscaler.cluster.search import search
from nnscaler.cluster.trace import TRACED_BLOCKS, block_stack, fewer_blocks, trace_shape

from tests.fixtures.llama_meta import meta_llama

pytest.importorskip("transformers")
H100 = get_profile("h100")


def _whole(model, batch):
    """The shape of ``model`` from a trace of every block (what trace_shape did before)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace_model(model, batch, None, registry=None, strict=False)
        return model_shape(graph, int(batch[0].shape[0]), int(batch[0].shape[1]))


def _short(model, batch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace_shape(model, batch)


def _facts(section):
    return [dataclasses.replace(o, name="") for o in section.ops]  # node names count the ops before them


def test_two_traced_blocks_give_the_shape_of_all_of_them():
    import opzoo  # noqa: F401
    model, batch = meta_llama(512, 1408, 256, 32000, layers=6)
    stack = block_stack(model)[2]
    whole, short = _whole(model, batch), _short(model, batch)
    assert model.model.model.layers is stack and len(stack) == 6  # the model got its blocks back
    assert short.layers == whole.layers == 6 and short.params == whole.params
    assert short.fwd_flops == pytest.approx(whole.fwd_flops, rel=1e-12)
    assert short.block_names == whole.block_names and short.buffers_bytes == whole.buffers_bytes
    for a, b in ((short.pre, whole.pre), (short.block, whole.block), (short.post, whole.post)):
        assert _facts(a) == _facts(b)
    for par in (Parallel(tp=2, pp=3, dp=2, micro_batch_size=1, num_microbatches=6, virtual_stages=2,
                         sequence_parallel=True, zero=1, recompute="selective"), Parallel(dp=8, zero=3)):
        gb = par.dp * par.micro_batch_size * par.num_microbatches
        a, b = (estimate(s, par, H100, "bf16-mixed", gb) for s in (short, whole))
        assert a.time == pytest.approx(b.time, rel=1e-12) and a.memory == pytest.approx(b.memory, rel=1e-12)
    cfg = ComputeConfig(16, profile="h100", precision="bf16-mixed", global_batch=32)
    assert search(short, cfg).parallel == search(whole, cfg).parallel


def test_blocks_sharing_parameters_are_traced_whole():
    """One block applied 4 times (ALBERT's sharing): two traced blocks would count its parameters 4 times
    over; the parameter check sees it and the whole model is traced."""
    import opzoo  # noqa: F401
    model, batch = meta_llama(512, 1408, 256, 32000, layers=4)
    inner = model.model.model
    inner.layers = torch.nn.ModuleList([inner.layers[0]] * 4)
    short = _short(model, batch)
    assert short.params == sum(p.numel() for p in model.parameters()) == _whole(model, batch).params


def test_fewer_blocks_restores_the_stack_on_error():
    model, _ = meta_llama(512, 1408, 256, 32000, layers=4)
    stack = model.model.model.layers
    with pytest.raises(RuntimeError):
        with fewer_blocks(model) as found:
            assert found == (4, stack[0]) and len(model.model.model.layers) == TRACED_BLOCKS
            raise RuntimeError("a failed trace")
    assert model.model.model.layers is stack
