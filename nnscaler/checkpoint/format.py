"""The checkpoint format every module type shares: ``nnscaler.json`` beside DCP's files (the optimizer's
class, its hyperparameters per group, the state keys of each parameter), the checks of a checkpoint
against the model and optimizer it loads into, and how optimizer state is planned and restored.

Keys: ``model.<name>`` (the single-device model's names and whole shapes) and
``optim.<name>.<state key>`` (a moment laid out like its parameter, a scalar ``step`` whole)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from .layout import load_buffer, sharded

if TYPE_CHECKING:
    from ..runtime.module import ParallelModule

META = "nnscaler.json"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model, plan or optimizer it is loaded into."""


def model_names(module: "ParallelModule") -> dict[str, str]:
    """Attribute key -> model name of the state a checkpoint carries (lifted constants are not state)."""
    constants = set(getattr(getattr(module, "graph", None), "constants", {}) or {})
    return {k: n for k, n in module._names.items() if n not in constants}


def hyper_params(group: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()
            if k != "params" and isinstance(v, (int, float, bool, str, tuple, list, type(None)))}


def read_meta(path: str | Path) -> tuple[dict, dict]:
    """The tensors a checkpoint holds (key -> DCP metadata) and its ``nnscaler.json``."""
    path = Path(path)
    if not (path / META).exists():
        raise CheckpointError(f"{path} is not an nnscaler checkpoint (no {META}); write one with nnscaler.checkpoint.save")
    return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata, json.loads((path / META).read_text())


def check_model(held: dict, expected: dict[str, tuple[int, ...]]) -> None:
    """Names and whole shapes of the checkpoint against the model's; errors name the tensor."""
    have = {k[len("model."):]: tuple(v.size) for k, v in held.items() if k.startswith("model.")}
    missing = sorted(set(expected) - set(have))
    unexpected = sorted(set(have) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"the checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")
    for name, shape in expected.items():
        if have[name] != tuple(shape):
            raise CheckpointError(f"{name}: the checkpoint holds shape {have[name]}, the model has {tuple(shape)}")


class PlainView:
    """A sharded optimizer (:class:`~nnscaler.runtime.zero.ZeroOptimizer`) seen as a plain one over the
    module's parameters, which is what a checkpoint stores: ``kind``, ``param_groups`` holding the
    module's parameters, and ``state`` per parameter (gathered over the zero group when ``gathered``:
    collective; the checkpoint then holds each piece once, as under zero 0, so it resumes under any
    zero stage and plan)."""

    def __init__(self, optimizer, gathered: bool):
        self.kind = optimizer.kind
        self.param_groups = [dict(g, params=optimizer.params()) for g in optimizer.param_groups]
        self.state = optimizer.param_state() if gathered else {}


def plain(optimizer, gathered: bool = True):
    """``optimizer`` as a checkpoint reads it: a :class:`PlainView` of a sharded one, else itself."""
    return PlainView(optimizer, gathered) if hasattr(optimizer, "param_state") else optimizer


def kind_of(optimizer) -> str:
    """The optimizer's class name, as a checkpoint records it (a sharded optimizer's inner class)."""
    return getattr(optimizer, "kind", type(optimizer).__name__)


def optimizer_state(optimizer, name_of, own=lambda p: True) -> tuple[dict, dict, list]:
    """Walk ``optimizer``'s parameters (``name_of(p)``: the model name of each, or raise): (the group of each
    name, the sorted state keys of each, and ``(p, key, tensor, laid_out)`` for the state of the parameters
    this rank stores (``own(p)``), ``key`` ``optim.NAME.STATE``, ``laid_out`` when the tensor is shaped like
    its parameter (stored sharded like it; otherwise a scalar stored whole))."""
    groups, keys, items = {}, {}, []
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            name = name_of(p)
            groups[name], keys[name] = gi, sorted(optimizer.state.get(p, {}))
            for k, v in optimizer.state.get(p, {}).items() if own(p) else ():
                v = v if isinstance(v, torch.Tensor) else torch.tensor(v)
                items.append((p, f"optim.{name}.{k}", v.detach(), v.shape == p.shape and v.dim() > 0))
    return groups, keys, items


FOREIGN = ("the optimizer holds a parameter this module does not have; build it over module.parameters()")


def finish_load(optimizer, view) -> None:
    """After :func:`restore_optimizer` into ``view = plain(optimizer, False)``: hand the loaded
    hyperparameters and state on to the sharded optimizer (each rank keeps its slices)."""
    if view is optimizer:
        return
    for group, loaded in zip(optimizer.param_groups, view.param_groups):
        group.update({k: v for k, v in loaded.items() if k != "params"})
    optimizer.load_param_state(view.state)


def frozen_keys(modules, keys: dict, groups: dict) -> None:
    """Every frozen parameter (``requires_grad=False``) of ``modules`` that the optimizer saved left out
    (a sharded optimizer is built over the trainable ones) holds no state: ``[]`` keys, so that a plain
    optimizer over all of a module's parameters, holding nothing for it either, resumes from it."""
    for mod in modules:
        for key, name in model_names(mod).items():
            p = getattr(mod, key)
            if isinstance(p, torch.nn.Parameter) and not p.requires_grad and name not in keys:
                keys[name], groups[name] = [], 0


def check_optimizer(meta: dict, optimizer: torch.optim.Optimizer, names: list[str]) -> None:
    """The checkpoint's optimizer state fits ``optimizer`` (same kind); errors name the parameter."""
    saved = meta.get("optimizer")
    if saved is None:
        raise CheckpointError("the checkpoint holds no optimizer state; save it with save(path, module, optimizer)")
    for name in names:
        keys = meta["state_keys"].get(name)
        if keys is None:
            raise CheckpointError(f"parameter {name}: the checkpoint holds no optimizer state for it")
        if saved != kind_of(optimizer):
            raise CheckpointError(f"parameter {name}: the checkpoint holds {saved} state ({', '.join(keys)}), "
                                  f"which a {kind_of(optimizer)} cannot resume from")


def _optimizer_buffer(module: "ParallelModule", name: str, param: torch.Tensor, md):
    """(buffer, cut, laid out like the parameter) for one saved optimizer state tensor of parameter
    ``name`` (``md``: its DCP metadata): a moment shaped like the whole parameter loads into the
    parameter's own piece (:func:`load_buffer`), anything else (a scalar ``step``) whole."""
    if tuple(md.size) == tuple(module._program.STATE[name][0]) and len(md.size):
        return (*load_buffer(module, name, param), True)
    return torch.empty(tuple(md.size), dtype=md.properties.dtype), lambda b: b, False


def optimizer_targets(held: dict, meta: dict, optimizer: torch.optim.Optimizer, place, state: dict) -> dict:
    """Check the checkpoint's optimizer state against ``optimizer`` and plan its load: add a buffer (a
    ``DTensor`` where laid out like the parameter) to DCP's ``state`` for each saved state tensor, and
    return parameter -> {key: (buffer, cut to this rank's piece)} for :func:`restore_optimizer`.
    ``place(param)``: (module holding it, that module's device mesh, model name). A state tensor
    already in ``state`` (a tied parameter held twice on this rank) is loaded once and shared."""
    order = [p for g in optimizer.param_groups for p in g["params"]]
    check_optimizer(meta, optimizer, [place(p)[2] for p in order])
    opt_state: dict = {}
    for p in order:
        mod, mesh, name = place(p)
        opt_state[p] = {}
        for k in meta["state_keys"][name]:
            key = f"optim.{name}.{k}"
            buf, cut, whole = _optimizer_buffer(mod, name, p, held[key])
            if key in state:
                opt_state[p][k] = (state[key], cut)
            else:
                opt_state[p][k] = (buf, cut)
                state[key] = sharded(mod, mesh, name, buf) if whole else buf
    return opt_state


def restore_optimizer(optimizer: torch.optim.Optimizer, meta: dict, opt_state: dict) -> None:
    """Put the loaded hyperparameters (``meta``'s, group by group) and state (``opt_state``: parameter ->
    {key: (loaded tensor or DTensor, cut to this rank's piece)}) into ``optimizer``."""
    for gi, group in enumerate(optimizer.param_groups):
        saved = meta["param_groups"][gi] if gi < len(meta["param_groups"]) else {}
        group.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items() if k in group})
    for p, st in opt_state.items():
        optimizer.state[p] = {k: cut(v._local_tensor if isinstance(v, DTensor) else v).contiguous()
                              for k, (v, cut) in st.items()}


