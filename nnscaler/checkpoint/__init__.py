"""Checkpoints of a parallelized model and its optimizer: sharded on ``torch.distributed.checkpoint``
(each rank writes and reads only its own pieces), loadable under any other plan, at any world size,
or on one device; and a merged single-file export of whole tensors. One format (:mod:`.format`) for a
:class:`~nnscaler.runtime.module.ParallelModule` (:mod:`.sharded`) and a pipeline (:mod:`.pipeline`)."""
from __future__ import annotations

from pathlib import Path

import torch

from . import pipeline, sharded
from .format import CheckpointError
from .single import export_merged, load_merged, load_single
from ..runtime.pipeline import PipelineModule


def save(path: str | Path, module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write ``module``'s pieces (and ``optimizer``'s state) under directory ``path``; every rank of
    the module calls this."""
    (pipeline if isinstance(module, PipelineModule) else sharded).save(path, module, optimizer)


def load(path: str | Path, module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a checkpoint written by :func:`save` under any plan (or a pipeline) into ``module`` (and
    ``optimizer``, built over ``module.parameters()``); each rank reads only what its pieces overlap."""
    (pipeline if isinstance(module, PipelineModule) else sharded).load(path, module, optimizer)


__all__ = ["CheckpointError", "save", "load", "export_merged", "load_merged", "load_single"]
