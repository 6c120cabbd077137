"""Users' ``context_parallel`` (torch's ring attention) on CPU ranks: torch's CP dispatcher knows only
the CUDA attention kernels (flash, efficient, cuDNN), so on CPU ``F.scaled_dot_product_attention`` of
the sequence-sharded DTensors it makes stops at ``aten._scaled_dot_product_flash_attention_for_cpu``
("does not have a sharding strategy registered"). :func:`cpu_ring_attention` adds the CPU flash kernel
and its backward to torch's own tables for the span of a case: a sequence-sharded (``Shard(2)``) DTensor
strategy in the sharding propagator, as torch's ``_sharding_rules`` registers the CUDA ones, and a
handler in the CP op table (``_attention.custom_ops``, which ``context_parallel`` merges into DTensor's
custom handlers on entry) that runs torch's own ``_templated_ring_attention`` (and its backward) with
the CPU kernel, which returns the log-sum-exp the ring merge needs. The algorithm, the rotate method
(``set_rotate_method``) and the head-tail load balancing stay torch's; only the per-block kernel is
the CPU one. ``_cp_options`` (torch's process-wide CP settings a user's ``fn`` may change) are restored
afterwards, so a case leaves the gang's ranks as it found them."""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.distributed.tensor import DTensor

aten = torch.ops.aten
SEQ_DIM = 2  # torch's CP shards (batch, heads, seq, head_dim) along seq
FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
NOTE = "ring attention (torch's context_parallel) run through the CPU flash-attention kernel"


def _forward_strategy(op_schema):
    """Outputs (out, logsumexp) and inputs (q, k, v) all sharded on the sequence."""
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Shard
    seq = Shard(SEQ_DIM)
    return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema,
                                           [[seq, seq, seq, seq, seq]], input_index=2)


def _backward_strategy(op_schema):
    """Outputs (grad q, k, v) and inputs (grad out, q, k, v, out, logsumexp) sharded on the sequence."""
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Shard
    seq = Shard(SEQ_DIM)
    return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(validate=False), op_schema,
                                           [[seq] * 9], input_index=3)


def _ring_forward(mesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention
    if attn_mask is not None or dropout_p:
        raise NotImplementedError("context_parallel on CPU: an attention mask or dropout is not supported "
                                  "(torch's ring attention takes neither)")
    return _templated_ring_attention(mesh.get_group(), SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu,
                                     query=query, key=key, value=value, is_causal=is_causal, dropout_p=0.0, scale=scale)


def _ring_backward(mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                   scale=None):
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention_backward
    return _templated_ring_attention_backward(mesh.get_group(), SEQ_DIM, BACKWARD, grad_out=grad_out,
                                              grad_out_name="grad_out", query=query, key=key, value=value, out=out,
                                              logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p,
                                              scale=scale)


_RING = {FORWARD: _ring_forward, BACKWARD: _ring_backward}


class Substituted:
    """How many ring-attention calls (forward and backward) ran through the CPU kernel in a case."""

    def __init__(self):
        self.calls = 0
        self.how: set[str] = set()  # torch's settings each call ran under: rotate method, load balance

    def note(self) -> str:
        return f"{NOTE} ({self.calls} calls; {', '.join(sorted(self.how))})" if self.calls else ""


def _handler(used: Substituted, op_call, args, kwargs):
    """torch's ``_sdpa_handler`` for the CPU kernel: unwrap, propagate (the strategies above), run the
    ring on the local tensors, wrap. Written here because torch's handler keeps its own closed map of
    CUDA ops to ring functions (``call_maps`` inside ``_sdpa_handler``)."""
    dispatcher = DTensor._op_dispatcher
    info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(info)
    sharding = info.output_sharding
    if sharding is None or sharding.needs_redistribute:
        raise RuntimeError(f"context_parallel on CPU: {op_call} needs its inputs sharded on the sequence (dim 2)")
    local = _RING[op_call](info.compute_mesh, *info.local_args, **info.local_kwargs)
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options
    used.calls += 1
    merge = ", blocks merged in float32 (torch's _cp_options.convert_to_f32)" \
        if _cp_options.convert_to_f32 and info.local_args[0].dtype == torch.float64 else ""
    used.how.add(f"rotate {_cp_options.rotate_method.name.lower()}, load balance "
                 f"{'on' if _cp_options.enable_load_balance else 'off'}{merge}")
    return dispatcher.wrap(local, sharding.output_spec)


@contextlib.contextmanager
def cpu_ring_attention():
    """For the span of a case: the CPU kernel in torch's CP op table and sharding strategies, and
    torch's ``_cp_options`` restored on exit; yields the case's :class:`Substituted`. A no-op where
    torch has no context parallelism."""
    used = Substituted()
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp
        from torch.distributed.tensor.experimental._context_parallel._sharding_rules import _op_strategy_context
    except ImportError:  # an older torch: nothing to extend
        yield used
        return
    options = dict(cp._cp_options.__dict__)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_op_strategy_context(FORWARD, _forward_strategy))
        stack.enter_context(_op_strategy_context(BACKWARD, _backward_strategy))
        added = [op for op in _RING if op not in cp.custom_ops]
        cp.custom_ops.update({op: functools.partial(_handler, used) for op in added})
        try:
            yield used
        finally:
            for op in added:
                cp.custom_ops.pop(op, None)
            cp._cp_options.__dict__.clear()
            cp._cp_options.__dict__.update(options)


def merges_in_float32() -> bool:
    """Whether torch's ring merges its blocks in float32 as now set (``_cp_options.convert_to_f32``, on
    by default): a float64 program using it is then no float64 program."""
    try:
        from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options
    except ImportError:
        return False
    return bool(_cp_options.convert_to_f32)
