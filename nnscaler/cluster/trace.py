"""The cluster planner's trace: a model read as repeated blocks (:mod:`nnscaler.cluster.blocks`), tracing
only :data:`TRACED_BLOCKS` of them.

The cost model needs one block, what comes before the blocks and what comes after; tracing all 80
blocks of a 70B model costs ~30 s of ``torch.export`` here for facts that 2 blocks give. So
:func:`trace_shape` swaps the model's stack of blocks (its longest ``nn.ModuleList`` of modules of
one class) for its first :data:`TRACED_BLOCKS` while it traces (restored after, even on error),
then extends the shape to the real block count (:func:`~nnscaler.cluster.blocks.with_layers`). The result
must account for every parameter of the real model; where it does not (blocks sharing parameters, a
forward that depends on how many blocks there are) or the short trace fails, the whole model is
traced instead.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch

from ..config import PlanError
from .blocks import ModelShape, model_shape, with_layers

TRACED_BLOCKS = 2  # two blocks: model_shape checks that the repeated block repeats


def block_stack(model: torch.nn.Module) -> tuple[torch.nn.Module, str, torch.nn.ModuleList] | None:
    """``(parent, attribute, stack)``: the longest ``nn.ModuleList`` of ``model`` whose entries are all
    of one class (a transformer's blocks), or ``None`` when there is none longer than :data:`TRACED_BLOCKS`."""
    best = None
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, torch.nn.ModuleList) and len(child) > TRACED_BLOCKS \
                    and len({type(m) for m in child}) == 1 and (best is None or len(child) > len(best[2])):
                best = (parent, name, child)
    return best


@contextlib.contextmanager
def fewer_blocks(model: torch.nn.Module, keep: int = TRACED_BLOCKS) -> Iterator[tuple[int, torch.nn.Module] | None]:
    """Within the block, ``model``'s block stack holds only its first ``keep`` blocks; yields
    ``(real block count, one block)`` or ``None`` when the model has no such stack."""
    found = block_stack(model)
    if found is None:
        yield None
        return
    parent, name, stack = found
    setattr(parent, name, torch.nn.ModuleList(list(stack)[:keep]))
    try:
        yield len(stack), stack[0]
    finally:
        setattr(parent, name, stack)


def _shape(model, sample_args, sample_kwargs, batch: int, seq: int) -> ModelShape:
    from ..compile.plan import trace_model
    graph = trace_model(model, sample_args, sample_kwargs, registry=None, strict=False)
    return model_shape(graph, batch, seq)


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # shared parameters once, as the trace names them


def trace_shape(model: torch.nn.Module, sample_args: Sequence[Any], sample_kwargs: dict | None = None) -> ModelShape:
    """Trace ``model`` (build it under ``torch.device("meta")`` to allocate nothing) and read it as
    repeated blocks, tracing two of them where that gives the same shape (see the module docstring).
    The first sample argument's shape is ``(batch, seq)`` of token ids."""
    x = sample_args[0] if sample_args else None
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise PlanError("plan_cluster: the first sample argument must be a (batch, seq) tensor of token ids")
    batch, seq = int(x.shape[0]), int(x.shape[1])
    total = _params(model)
    try:
        with fewer_blocks(model) as found:
            if found is not None:
                layers, block = found
                short = _shape(model, sample_args, sample_kwargs, batch, seq)
                if short.layers == TRACED_BLOCKS:
                    bufs = sum(b.numel() * b.element_size() for b in block.buffers())
                    shape = with_layers(short, layers, bufs)
                    if shape.params == total:
                        return shape
    except Exception:  # noqa: BLE001  (a forward that needs all its blocks: trace them all, below)
        pass
    try:
        return _shape(model, sample_args, sample_kwargs, batch, seq)
    except ValueError as exc:
        raise PlanError(f"plan_cluster: {exc}") from None
