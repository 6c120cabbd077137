"""Sharded save and load of a :class:`~nnscaler.runtime.module.ParallelModule` and its optimizer with
``torch.distributed.checkpoint`` (DCP): every rank writes only its own pieces (replicated pieces
once), and a checkpoint loads under any plan at any world size (DCP reads the overlapping pieces).

The directory's layout and ``nnscaler.json``: :mod:`.format`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .format import (FOREIGN, META, CheckpointError, check_model, finish_load, frozen_keys, hyper_params, kind_of,
                     model_names, optimizer_state, optimizer_targets, read_meta, restore_optimizer)
from .format import plain as plain_view
from .layout import device_mesh, gather_blocks, load_buffer, sharded

if TYPE_CHECKING:
    from ..runtime.module import ParallelModule
def _param_names(module: "ParallelModule") -> dict[int, str]:
    return {id(getattr(module, k)): n for k, n in model_names(module).items()
            if isinstance(getattr(module, k), torch.nn.Parameter)}


def save(path: str | Path, module: "ParallelModule", optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write ``module``'s pieces (and ``optimizer``'s state) under directory ``path``; every rank of
    the module calls this (under zero 3 its parameters are gathered from their shards for it)."""
    with module.materialized():
        _save(path, module, optimizer)


def _save(path, module, optimizer) -> None:
    mesh = device_mesh(module)
    pieces: dict[str, tuple[str, torch.Tensor]] = {}  # checkpoint key -> (model name it is laid out like, piece)
    plain: dict[str, torch.Tensor] = {}  # optimizer scalars, stored whole
    for key, name in model_names(module).items():
        pieces[f"model.{name}"] = (name, getattr(module, key).detach())
    meta = {"optimizer": None}
    if optimizer is not None:
        kind, optimizer = kind_of(optimizer), plain_view(optimizer)  # a sharded optimizer's state gathered per parameter
        names = _param_names(module)

        def name_of(p):
            if id(p) not in names:
                raise CheckpointError(FOREIGN)
            return names[id(p)]
        groups, keys, items = optimizer_state(optimizer, name_of)
        for p, k, v, laid_out in items:
            if laid_out:
                pieces[k] = (names[id(p)], v)
            else:
                plain[k] = v
        frozen_keys([module], keys, groups)
        meta = {"optimizer": kind, "param_groups": [hyper_params(g) for g in optimizer.param_groups],
                "group_of": groups, "state_keys": keys}
    whole = gather_blocks(module, list(pieces.values())) if mesh is not None else [t for _, t in pieces.values()]
    state = {k: sharded(module, mesh, name, t) for (k, (name, _)), t in zip(pieces.items(), whole)}
    dcp.save({**state, **plain}, checkpoint_id=str(path), process_group=module.process_group)
    if not dist.is_initialized() or dist.get_rank() == 0:  # the module's ranks are 0 .. runtime_ngpus-1
        Path(path, META).write_text(json.dumps(meta, indent=1))
    if dist.is_initialized():
        dist.barrier(group=module.process_group)


def load(path: str | Path, module: "ParallelModule", optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a checkpoint written by :func:`save` under any plan into ``module`` (and ``optimizer``,
    built over ``module.parameters()``); each rank reads only what its pieces overlap (under zero 3 into
    its parameters gathered, then sharded again)."""
    with module.materialized(writeback=True):
        _load(path, module, optimizer)


def _load(path, module, optimizer) -> None:
    held, meta = read_meta(path)
    names = model_names(module)
    check_model(held, {n: module._program.STATE[n][0] for n in names.values()})
    mesh = device_mesh(module)
    state, targets = {}, []
    for key, name in names.items():
        dest = getattr(module, key)
        buf, cut = load_buffer(module, name, dest)
        state[f"model.{name}"] = sharded(module, mesh, name, buf)
        targets.append((dest, buf, cut))
    view = None if optimizer is None else plain_view(optimizer, gathered=False)
    if optimizer is not None:
        pnames = _param_names(module)
        opt_state = optimizer_targets(held, meta, view, lambda p: (module, mesh, pnames[id(p)]), state)
    dcp.load(state, checkpoint_id=str(path), process_group=module.process_group)
    with torch.no_grad():
        for dest, buf, cut in targets:
            dest.copy_(cut(buf))
    if optimizer is not None:
        restore_optimizer(view, meta, opt_state)
        finish_load(optimizer, view)
