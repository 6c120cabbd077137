"""Parallelizations written with PyTorch's own tools, as users write them, for the torchtitan-style
Llama of :mod:`verify.models.titan_llama`: each is ``fn(model, mesh)`` (the contract of
``verify model --parallelize``, :mod:`verify.cases.torchpar.case`). The correct ones follow torchtitan's
plan (``torchtitan/models/llama3/infra/parallelize.py``); the ``wrong_*`` ones are known mistakes that
the harness must catch and localise."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

from verify.api import Parallelized


def _tp(mesh: DeviceMesh) -> DeviceMesh:
    return mesh["tp"] if mesh.mesh_dim_names and len(mesh.mesh_dim_names) > 1 else mesh


def _block_plan(attention: bool = True, o_style=None) -> dict:
    """torchtitan's plan of one block: sequence-parallel norms, the attention and feed-forward inputs
    gathered along the sequence, column-wise in-projections, row-wise out-projections that
    reduce-scatter back along the sequence."""
    plan = {
        "attention_norm": SequenceParallel(),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    if attention:
        plan.update({
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None),  # the rotary table stays local
                                            desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": o_style or RowwiseParallel(output_layouts=Shard(1)),
        })
    return plan


def _top_plan(loss_par: bool) -> dict:
    return {
        "model.tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "model.output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_par else Replicate(),
                                        use_local_output=not loss_par),
    }


def _apply(model: nn.Module, tp: DeviceMesh, loss_par: bool = True, **block) -> nn.Module:
    parallelize_module(model, tp, _top_plan(loss_par))
    for name, layer in model.model.layers.items():
        parallelize_module(layer, tp, _block_plan(**block))
    return model


def titan_tp(model: nn.Module, mesh: DeviceMesh) -> Parallelized:
    """torchtitan's tensor and sequence parallelism with loss parallelism: the logits stay split
    along the vocabulary (unevenly: 101 over 2 ranks) into ``loss_parallel``'s cross-entropy."""
    return Parallelized(_apply(model, _tp(mesh)), step_context=loss_parallel)


def titan_tp_replicated_logits(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """The same without loss parallelism: the output projection gathers the logits."""
    return _apply(model, _tp(mesh), loss_par=False)


def fsdp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """FSDP2 over the whole (data-parallel) mesh: each block, then the root (torchtitan's order)."""
    for layer in model.model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp_tp(model: nn.Module, mesh: DeviceMesh) -> Parallelized:
    """2-D: torchtitan's tensor parallelism over ``tp``, then FSDP2 over ``dp``."""
    _apply(model, mesh["tp"])
    fsdp(model, mesh["dp"])
    return Parallelized(model, step_context=loss_parallel)


# -- known-wrong plans -------------------------------------------------------------------------------

def titan_tp_wo_colwise(model: nn.Module, mesh: DeviceMesh) -> Parallelized:
    """torchtitan's plan with the attention output projection, a row-wise layer, declared column-wise
    *with* its layouts (input split along the features, output along the sequence): DTensor gathers
    the input and moves the output itself, so the program is right (only slower)."""
    style = ColwiseParallel(input_layouts=Shard(-1), output_layouts=Shard(1))
    return Parallelized(_apply(model, _tp(mesh), o_style=style), step_context=loss_parallel)


def wrong_rowwise_as_colwise(model: nn.Module, mesh: DeviceMesh) -> Parallelized:
    """The attention output projection, a row-wise layer, declared ``ColwiseParallel()``: its input
    (each rank's heads) is taken as the whole replicated input. DTensor's shape tracking refuses the
    matmul, so this one raises (in ``wo``) rather than computing wrong numbers."""
    return Parallelized(_apply(model, _tp(mesh), o_style=ColwiseParallel()), step_context=loss_parallel)


def wrong_missing_sp_gather(model: nn.Module, mesh: DeviceMesh) -> Parallelized:
    """Sequence parallelism whose attention input is never gathered along the sequence: the
    attention keeps replicated weights and runs on each rank's piece of the sequence alone."""
    tp = _tp(mesh)
    parallelize_module(model, tp, _top_plan(True))
    for layer in model.model.layers.values():
        parallelize_module(layer, tp, {**_block_plan(attention=False),
                                       "attention_norm": SequenceParallel(use_local_output=True)})
    return Parallelized(model, step_context=loss_parallel)


class VocabParallelCrossEntropy(nn.Module):
    """Megatron-style vocabulary-parallel cross-entropy on this rank's columns of the logits, with
    the vocabulary range computed as ``rank * (vocab // tp)``: right only when the degree divides
    the vocabulary (DTensor shards 101 over 2 ranks as 51 + 50, not 50 + 51)."""

    def __init__(self, vocab: int, group):
        super().__init__()
        self.vocab, self.group = vocab, group

    def forward(self, logits, labels):
        local = logits.to_local() if isinstance(logits, DTensor) else logits
        local = local.flatten(0, 1)
        labels = labels.flatten(0, 1)
        tp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        start = rank * (self.vocab // tp)  # the bug: assumes an even split
        peak = local.detach().max(dim=-1, keepdim=True).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.group)
        sum_exp = _AllReduceSum.apply((local - peak).exp().sum(-1), self.group)
        mine = (labels >= start) & (labels < start + local.shape[-1])
        picked = torch.where(mine, local.gather(-1, (labels - start).clamp(0, local.shape[-1] - 1)[:, None])[:, 0]
                             - peak[:, 0], torch.zeros((), dtype=local.dtype))
        target = _AllReduceSum.apply(picked, self.group)
        return (sum_exp.log() - target).mean()


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group forward; the gradient passes through (each rank's terms are its own)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def wrong_vocab_offsets(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """torchtitan's plan with the logits left split along the vocabulary into a hand-written
    vocabulary-parallel cross-entropy that assumes ``vocab % tp == 0``."""
    tp = _tp(mesh)
    parallelize_module(model, tp, {**_top_plan(True), "model.output": ColwiseParallel(
        input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)})
    for layer in model.model.layers.values():
        parallelize_module(layer, tp, _block_plan())
    model.loss = VocabParallelCrossEntropy(model.model.output.weight.shape[0], tp.get_group())
    return model


PLANS = {"titan_tp": titan_tp, "titan_tp_replicated_logits": titan_tp_replicated_logits, "fsdp": fsdp,
         "fsdp_tp": fsdp_tp, "titan_tp_wo_colwise": titan_tp_wo_colwise, "wrong_rowwise_as_colwise": wrong_rowwise_as_colwise,
         "wrong_missing_sp_gather": wrong_missing_sp_gather, "wrong_vocab_offsets": wrong_vocab_offsets}
"""The plans by name (``verify.rows.torchpar_builtin`` lists which model and mesh each runs on)."""


# -- transformers' own tensor-parallel plans ---------------------------------------------------------

def hf_tp_auto(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """transformers' ``tp_plan="auto"``: the model's own ``base_model_tp_plan`` (column-wise q/k/v and
    gate/up, row-wise o/down, the LM head's ``colwise_gather_output``) resolved and applied on the
    mesh by the functions ``from_pretrained(..., tp_plan="auto")`` runs
    (``_resolve_parallel_plans``, ``apply_tensor_parallelism``). Those take a model built by
    ``from_pretrained`` on a mesh transformers builds from ``torchrun``'s environment; here the tiny
    model is built from a config and the mesh is the harness's, so they are called directly."""
    from transformers.distributed.configuration_utils import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    hf = model.model  # verify.models.common.LossOf around the transformers model
    plan, _, _ = hf._resolve_parallel_plans(DistributedConfig(tp_plan="auto", tp_size=mesh.size()))
    apply_tensor_parallelism(hf, mesh, plan)
    return model
