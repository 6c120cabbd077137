"""Batch normalisation in training: its statistics span the batch, so a split of the batch is
SyncBatchNorm's program, the one that equals one device.

``aten._native_batch_norm_legit_functional(x, weight, bias, running_mean, running_var, training,
momentum, eps) -> (out, save_mean, save_invstd, new_running_mean, new_running_var)``::

    n c a^ b^, c, c, c, c, ?, ?, ? -> n c a^ b^, c, c, c, c

The channels ``c`` split plainly (each rank normalises its own channels). The batch ``n`` is
*batch-coupled*: :func:`sync_batch_norm` gathers every rank's per-channel (mean, sum of squared
deviations) in ONE collective (forward; its backward is one reduce-scatter) and combines them
exactly (Chan et al.'s pairwise formula, stable where ``E[x^2] - E[x]^2`` is not), as torch's
``SyncBatchNorm`` does with its one all-gather. One collective per layer and step is inherent to
any program that equals one device (torch DDP without SyncBatchNorm keeps local statistics, which
is another model); the spec names ``n`` in ``coupled`` so plan reports count these collectives
apart from the layout conversions (``nnscaler.policies.tp_check.coupled_collectives``).
"""
from __future__ import annotations

from functools import partial

import torch

from nnscaler.ops import OpCall, TensorMeta
from nnscaler.ops.registry import DEFAULT_REGISTRY
from nnscaler.runtime import collectives as C

from ..rulekit import Names, T, build, mark, register_examples, usable

FAMILY = "nn"
OVERLOAD = "aten._native_batch_norm_legit_functional.default"


def batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    """aten's layer; the running statistics are buffers (no gradient), whatever the caller passes."""
    return torch.ops.aten._native_batch_norm_legit_functional.default(
        x, weight, bias, running_mean.detach(), running_var.detach(), training, momentum, eps)


def sync_batch_norm(shard, x, weight, bias, running_mean, running_var, training, momentum, eps, *, ident="n"):
    """The layer on this rank's samples with the statistics of the whole batch (``ident`` split).
    Written out (torch's ``batch_norm_gather_stats_with_counts`` and ``batch_norm_elemt`` are CUDA
    kernels; this runs on gloo/CPU and in float64 for the harness's reference)."""
    group = shard.group(ident)
    if group is None or not training:
        return batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps)
    dims = [0, *range(2, x.ndim)]
    shape = [1, -1] + [1] * (x.ndim - 2)
    count = x.numel() // x.shape[1]  # per rank: the batch splits evenly
    mean_r = x.mean(dims)
    m2_r = (x - mean_r.view(shape)).square().sum(dims)
    stats = C.all_gather_sum_grad(torch.stack([mean_r, m2_r]).unsqueeze(0), 0, group)  # (ranks, 2, c)
    means, m2s = stats[:, 0], stats[:, 1]
    mean = means.mean(0)
    total = count * stats.shape[0]
    var = (m2s.sum(0) + count * (means - mean).square().sum(0)) / total
    invstd = torch.rsqrt(var + eps)
    out = (x - mean.view(shape)) * invstd.view(shape)
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    running_mean, running_var = running_mean.detach(), running_var.detach()
    with torch.no_grad():  # aten's statistics outputs carry no gradient
        new_mean = running_mean * (1 - momentum) + mean * momentum
        new_var = running_var * (1 - momentum) + var * (total / max(total - 1, 1)) * momentum
        return out, mean.detach(), invstd.detach(), new_mean, new_var


def batch_norm_rule(call: OpCall):
    """``n c a^ b^, c, c, c, c, ?, ?, ? -> n c a^ b^, c, c, c, c``; ``n`` is batch-coupled."""
    if not usable(call) or len(call.args) < 8:
        return None
    x = call.tensor(0)
    if x.ndim < 2 or any(not isinstance(call.args[p], TensorMeta) or tuple(call.args[p].shape) != (x.shape[1],)
                         for p in (3, 4)):
        return None
    names = Names()
    n, c = names.dim(x.shape[0]), names.dim(x.shape[1])
    din = [n, c] + [mark(names.dim(s), "^") for s in x.shape[2:]]
    ins = {0: din, 3: [c], 4: [c]}
    for p in (1, 2):
        t = call.args[p]
        if isinstance(t, TensorMeta):
            if tuple(t.shape) != (x.shape[1],):
                return None
            ins[p] = [c]
    coupled = (n,) if not n.isdigit() else ()
    return build(call, FAMILY, ins, [din, [c], [c], [c], [c]], fn=batch_norm, local=partial(sync_batch_norm, ident=n),
                 coupled=coupled)


DEFAULT_REGISTRY.add_rule(OVERLOAD, batch_norm_rule)

register_examples(OVERLOAD, [(T(4, 6, 5, 5), T(6), T(6), T(6), T(6), True, 0.1, 1e-5),
                             (T(8, 4, 6), None, None, T(4), T(4), True, 0.1, 1e-5),
                             (T(8, 6), T(6), T(6), T(6), T(6), True, 0.1, 1e-5)])
