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
* Pipelines: ``fn`` may instead return :class:`Pipelined` (this rank's ``PipelineStage``\ s and their
  ``torch.distributed.pipelining`` schedule), or what torchtitan's ``pipeline_llm`` returns (``(schedule,
  model_parts, has_first_stage, has_last_stage)``), on a mesh with a dimension named ``pp``. The step's
  arguments are ``(inputs..., target)``: the first stage takes the inputs, the schedule's ``loss_fn`` the last
  stage's output and the target; the step's loss is the sum of the micro-batch losses (their mean where the
  schedule scales gradients, ``scale_grads=True``). Stage modules keep the model's parameter names, less a
  prefix common to all (a stage cut from ``model.model`` names ``layers.0...``, not ``model.layers.0...``):
  :mod:`verify.cases.torchpar.pipeline`.
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


@dataclass
class Pipelined:
    """``fn``'s answer for a pipeline: ``schedule`` (a ``torch.distributed.pipelining`` schedule: GPipe, 1F1B,
    interleaved, zero bubble) and this rank's ``stages`` (default: the schedule's own). ``prefix``: what the
    model's parameter names add before a stage module's (default: found from the names)."""

    schedule: object = None
    stages: list | None = None
    prefix: str | None = None

    @property
    def module(self) -> nn.ModuleList:
        """This rank's stage modules (whatever each stage runs now: torchtitan replaces ``submod``)."""
        return nn.ModuleList([s.submod for s in self.stages or ()])


def _is_schedule(obj) -> bool:
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
    return isinstance(obj, (PipelineScheduleSingle, PipelineScheduleMulti))


def _is_stage(obj) -> bool:
    return hasattr(obj, "submod") and hasattr(obj, "stage_index") and hasattr(obj, "is_last")


def schedule_stages(schedule) -> list:
    """The stages a schedule runs on this rank (torch keeps them as ``_stages``, or ``_stage`` for one)."""
    return list(getattr(schedule, "_stages", None) or [getattr(schedule, "_stage")])


def pipelined(result, fn_name: str) -> Pipelined | None:
    """``result`` as a :class:`Pipelined` where it is a pipeline (``Pipelined``, a bare schedule, torchtitan's
    ``pipeline_llm`` tuple); ``None`` where it is none; :class:`ParallelizeError` for stages without a schedule."""
    if isinstance(result, tuple) and result and _is_schedule(result[0]):  # torchtitan's pipeline_llm
        result = Pipelined(result[0])
    elif _is_schedule(result):
        result = Pipelined(result)
    stages = result.stages if isinstance(result, Pipelined) else result if isinstance(result, (list, tuple)) else None
    if isinstance(result, Pipelined) or (stages and all(_is_stage(s) for s in stages)) or _is_stage(result):
        if not isinstance(result, Pipelined) or not _is_schedule(result.schedule):
            got = "no schedule" if not isinstance(result, Pipelined) or result.schedule is None \
                else f"schedule={type(result.schedule).__name__}"
            raise ParallelizeError(f"--parallelize {fn_name}: returned pipeline stages with {got}; return "
                                   f"verify.torch_parallel.Pipelined(schedule, stages) with a torch.distributed."
                                   f"pipelining schedule (ScheduleGPipe, Schedule1F1B, ...) built on them")
        own = schedule_stages(result.schedule)
        if result.stages is None:
            result.stages = own
        elif [id(s) for s in result.stages] != [id(s) for s in own]:
            raise ParallelizeError(f"--parallelize {fn_name}: the stages it returns are not those its schedule runs")
        return result
    return None


class ParallelizeError(ValueError):
    """``fn`` returned something the harness cannot train (exit 2 before ranks start)."""


def unpack(result, fn_name: str) -> Parallelized | Pipelined:
    """``fn``'s return value as a :class:`Parallelized`; :class:`ParallelizeError` if it is neither a
    module nor a ``Parallelized`` holding one. A pipeline is returned as a :class:`Pipelined`."""
    pipe = pipelined(result, fn_name)
    if pipe is not None:
        return pipe
    if isinstance(result, nn.Module):
        return Parallelized(result)
    if isinstance(result, Parallelized) and isinstance(result.module, nn.Module) and callable(result.step_context) \
            and (result.batch_context is None or callable(result.batch_context)):
        return result
    got = "None (did it forget `return model`?)" if result is None else type(result).__name__
    raise ParallelizeError(f"--parallelize {fn_name}: returned {got}; it must return the parallelized "
                           f"torch.nn.Module (or verify.torch_parallel.Parallelized(module, step_context=...))")
