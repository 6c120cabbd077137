"""Sharded checkpoints of a :class:`~nnscaler.runtime.pipeline.PipelineModule`, in the format of
:mod:`nnscaler.checkpoint` (keys ``model.<name>`` and ``optim.<name>.<state key>`` under the whole
model's names and shapes), so a pipeline's checkpoint loads under any other plan or on one device,
and any checkpoint loads into a pipeline. Each stage writes the tensors whose owner it is (a tied
parameter is written once, by its first stage) and reads every tensor it holds."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from .format import (FOREIGN, META, CheckpointError, check_model, finish_load, frozen_keys, hyper_params, kind_of,
                     model_names, optimizer_state, optimizer_targets, read_meta, restore_optimizer)
from .format import plain as plain_view
from .layout import device_mesh, gather_blocks, load_buffer, sharded


def _params(pm) -> dict[int, tuple]:
    """id(local parameter) -> (stage module, its mesh, model name, whether this stage owns it)."""
    out = {}
    for s, mod in pm.stages.items():
        mesh = device_mesh(mod)
        for key, name in model_names(mod).items():
            p = getattr(mod, key)
            if isinstance(p, torch.nn.Parameter):
                out[id(p)] = (mod, mesh, name, pm._owner.get(name) == int(s))
    return out


def _materialized(pm, writeback: bool = False) -> contextlib.ExitStack:
    """Every stage's parameters whole (zero 3 gathers its shards; see ``ParallelModule.materialized``)."""
    stack = contextlib.ExitStack()
    for _, mod in sorted(pm.stages.items()):
        stack.enter_context(mod.materialized(writeback))
    return stack


def save(path: str | Path, pm, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write ``pm``'s pieces (and ``optimizer``'s state) under directory ``path``; every rank calls this."""
    with _materialized(pm):
        _save(path, pm, optimizer)


def _save(path, pm, optimizer) -> None:
    pieces: dict[int, dict[str, tuple[str, torch.Tensor]]] = {}  # stage -> key -> (name laid out like, piece)
    for s, mod in pm.stages.items():
        pieces[s] = {}
        for key, name in model_names(mod).items():
            if pm._owner.get(name) == int(s):
                pieces[s][f"model.{name}"] = (name, getattr(mod, key).detach())
    plain: dict[str, torch.Tensor] = {}  # optimizer scalars, stored whole
    meta = {"optimizer": None}
    if optimizer is not None:
        kind, optimizer = kind_of(optimizer), plain_view(optimizer)  # a sharded optimizer's state gathered per parameter
        params = _params(pm)
        stage_of = {id(mod): s for s, mod in pm.stages.items()}

        def name_of(p):
            if id(p) not in params:
                raise CheckpointError(FOREIGN)
            return params[id(p)][2]
        groups, keys, items = optimizer_state(optimizer, name_of, own=lambda p: params[id(p)][3])
        for p, k, v, laid_out in items:
            if laid_out:
                pieces[stage_of[id(params[id(p)][0])]][k] = (params[id(p)][2], v)
            else:
                plain[k] = v
        parts: list = [None] * dist.get_world_size(pm.process_group)
        dist.all_gather_object(parts, (groups, keys), group=pm.process_group)  # every stage's parameters
        for g, k in parts:
            groups.update(g)
            keys.update(k)
        frozen_keys(pm.stages.values(), keys, groups)
        meta = {"optimizer": kind, "param_groups": [hyper_params(g) for g in optimizer.param_groups],
                "group_of": groups, "state_keys": keys}
    state: dict[str, torch.Tensor] = dict(plain)
    for s in sorted(pieces):  # the ranks of a stage hold the same names in the same order
        mod, mesh = pm.stages[s], device_mesh(pm.stages[s])
        items = pieces[s]
        # pieces split in blocks (a fused qkv) are made whole on their axis first, as nnscaler.checkpoint does
        whole = gather_blocks(mod, list(items.values())) if mesh is not None else [t for _, t in items.values()]
        state.update({k: sharded(mod, mesh, name, t) for (k, (name, _)), t in zip(items.items(), whole)})
    dcp.save(state, checkpoint_id=str(path), process_group=pm.process_group)
    if dist.get_rank() == 0:
        Path(path, META).write_text(json.dumps(meta, indent=1))
    dist.barrier(group=pm.process_group)


def load(path: str | Path, pm, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a checkpoint written under any plan into ``pm`` (and ``optimizer``, over ``pm.parameters()``)."""
    with _materialized(pm, writeback=True):
        _load(path, pm, optimizer)


def _load(path, pm, optimizer) -> None:
    held, meta = read_meta(path)
    constants = set(pm.graph.constants)
    check_model(held, {n: s for n, s in pm._shapes.items() if n not in constants})
    state, targets, again = {}, [], []
    for s, mod in pm.stages.items():
        mesh = device_mesh(mod)
        for key, name in model_names(mod).items():
            dest = getattr(mod, key)
            if f"model.{name}" in state:  # a tied parameter held twice on this rank: loaded once, copied
                again.append((dest, state[f"model.{name}"]))
                continue
            buf, cut = load_buffer(mod, name, dest)
            state[f"model.{name}"] = sharded(mod, mesh, name, buf)
            targets.append((dest, buf, cut))
    view = None if optimizer is None else plain_view(optimizer, gathered=False)
    if optimizer is not None:
        params = _params(pm)
        opt_state = optimizer_targets(held, meta, view, lambda p: params[id(p)][:3], state)
    dcp.load(state, checkpoint_id=str(path), process_group=pm.process_group)
    local = lambda v: v._local_tensor if isinstance(v, DTensor) else v  # noqa: E731
    with torch.no_grad():
        for dest, buf, cut in targets:
            dest.copy_(cut(buf))
        for dest, src in again:
            dest.copy_(local(src))
    if optimizer is not None:
        restore_optimizer(view, meta, opt_state)
        finish_load(optimizer, view)


def whole_moments(pm, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """``{name: {state key: whole tensor}}`` of ``optimizer``'s state, merged across stages."""
    params, state = _params(pm), plain_view(optimizer).state
    mine = {}
    for s, mod in pm.stages.items():  # every rank of a stage gathers the same names in the same order
        for key, name in model_names(mod).items():
            p = getattr(mod, key)
            if isinstance(p, torch.nn.Parameter) and params[id(p)][3] and p in state:
                mine[name] = {k: (mod._whole(name, v) if v.dim() else v) for k, v in state[p].items()}
    parts: list = [None] * pm._pp
    dist.all_gather_object(parts, mine, group=pm._pp_group)
    return {n: st for part in parts for n, st in part.items()}
