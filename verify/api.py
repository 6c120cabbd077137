"""What ``fn(model, mesh)`` of ``verify model --parallelize FILE.py:fn`` may return, and how the harness
reads it.

The contract, stated once:

* The harness builds the model afresh from its builder (never a copy), builds a ``DeviceMesh`` over
  the case's ranks (1-D, named by ``--mesh``, ``tp`` unless told; or 2-D such as ``dp=2,tp=2``) and
  calls ``fn(model, mesh)`` on every rank. ``fn`` applies the user's own parallelization
  (``parallelize_module`` plans, ``fully_shard``, a transformers ``tp_plan``, any mix) and returns the
  module to train: the model itself, or a module with the same parameter names; or a
  :class:`Parallelized` when every step must run inside a context (``loss_parallel``, or
  ``context_parallel`` over the step's own tensors: ``batch_context``).
* Batch: each step's arguments are split along dim 0 over the mesh dimension named ``dp`` (each
  ``dp`` coordinate takes its contiguous slice; the batch must divide); every other dimension gets
  the whole batch. The module returns its scalar loss, a mean over the batch rows: the step's loss
  is the mean of the ``dp`` ranks' losses (and of the ``cp`` ranks': a mesh dimension named ``cp`` holds
  context parallelism, each rank's loss the mean over its own sequence chunks, which
  ``batch_context`` cuts from the whole sequence every rank is given), and the gradients must be those of the single-device
  model on the whole batch (FSDP2 averages over ``dp`` by itself; a plain replicated module does
  not, and is caught).
* Compared, as for compiled plans (:mod:`verify.judge.compare`): the loss, every parameter's
  gradient (``full_tensor()`` of a DTensor), the parameters after each AdamW step, and a resume
  through ``torch.distributed.checkpoint`` onto one device.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch.nn as nn


@dataclass
class Parallelized:
    """``fn``'s answer when training needs more than the module: ``step_context`` (a
    context-manager factory, e.g. ``torch.distributed.tensor.parallel.loss_parallel``) is entered
    around every forward and backward of a step. ``batch_context``, when given, is called with the
    step's arguments (this rank's own copies: it may shard them in place, as
    ``context_parallel(mesh, buffers=[*args, ...], buffer_seq_dims=...)`` does) and entered inside
    ``step_context``, around the same forward and backward."""

    module: nn.Module
    step_context: Callable[[], ContextManager] = contextlib.nullcontext
    batch_context: Callable[..., ContextManager] | None = None


class ParallelizeError(ValueError):
    """``fn`` returned something the harness cannot train (exit 2 before ranks start)."""


def unpack(result, fn_name: str) -> Parallelized:
    """``fn``'s return value as a :class:`Parallelized`; :class:`ParallelizeError` if it is neither a
    module nor a ``Parallelized`` holding one."""
    if isinstance(result, nn.Module):
        return Parallelized(result)
    if isinstance(result, Parallelized) and isinstance(result.module, nn.Module) and callable(result.step_context) \
            and (result.batch_context is None or callable(result.batch_context)):
        return result
    got = "None (did it forget `return model`?)" if result is None else type(result).__name__
    raise ParallelizeError(f"--parallelize {fn_name}: returned {got}; it must return the parallelized "
                           f"torch.nn.Module (or verify.torch_parallel.Parallelized(module, step_context=...))")
