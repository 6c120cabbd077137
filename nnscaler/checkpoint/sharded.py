"""Sharded save and load of a :class:`~nnscaler.runtime.module.ParallelModule` and its optimizer with
``torch.distributed.checkpoint`` (DCP): every rank writes only its own pieces (replicated pieces
once), and a checkpoint loads under any plan at any world size (DCP reads the overlapping pieces).

Layout of a checkpoint directory: DCP's files, with keys ``model.<name>`` (the single-device model's
names and whole shapes) and ``optim.<name>.<state key>`` (a moment laid out like its parameter, a
scalar ``step`` whole), plus ``nnscaler.json``: the optimizer's class, its hyperparameters per group,
and which state keys each parameter has.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from .layout import device_mesh, gather_blocks, load_buffer, sharded

if TYPE_CHECKING:
    from ..runtime.module import ParallelModule

META = "nnscaler.json"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model, plan or optimizer it is loaded into."""


def model_names(module: "ParallelModule") -> dict[str, str]:
    """Attribute key -> model name of the state a checkpoint carries (lifted constants are not state)."""
    constants = set(getattr(getattr(module, "graph", None), "constants", {}) or {})
    return {k: n for k, n in module._names.items() if n not in constants}


def _param_names(module: "ParallelModule") -> dict[int, str]:
    return {id(getattr(module, k)): n for k, n in model_names(module).items()
            if isinstance(getattr(module, k), torch.nn.Parameter)}


def _hyper(group: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()
            if k != "params" and isinstance(v, (int, float, bool, str, tuple, list, type(None)))}


def save(path: str | Path, module: "ParallelModule", optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write ``module``'s pieces (and ``optimizer``'s state) under directory ``path``; every rank of
    the module calls this."""
    if hasattr(module, "stages"):  # a pipeline: nnscaler.pipeline.checkpoint, in this format
        from ..pipeline.checkpoint import save as save_pipeline
        return save_pipeline(path, module, optimizer)
    mesh = device_mesh(module)
    pieces: dict[str, tuple[str, torch.Tensor]] = {}  # checkpoint key -> (model name it is laid out like, piece)
    plain: dict[str, torch.Tensor] = {}  # optimizer scalars, stored whole
    for key, name in model_names(module).items():
        pieces[f"model.{name}"] = (name, getattr(module, key).detach())
    meta = {"optimizer": None}
    if optimizer is not None:
        names = _param_names(module)
        keys, groups = {}, {}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in names:
                    raise CheckpointError("the optimizer holds a parameter this module does not have; build it "
                                          "over module.parameters()")
                name = names[id(p)]
                groups[name] = gi
                keys[name] = sorted(optimizer.state.get(p, {}))
                for k, v in optimizer.state.get(p, {}).items():
                    v = v if isinstance(v, torch.Tensor) else torch.tensor(v)
                    if v.shape == p.shape and v.dim():
                        pieces[f"optim.{name}.{k}"] = (name, v.detach())
                    else:
                        plain[f"optim.{name}.{k}"] = v.detach()
        meta = {"optimizer": type(optimizer).__name__, "param_groups": [_hyper(g) for g in optimizer.param_groups],
                "group_of": groups, "state_keys": keys}
    whole = gather_blocks(module, list(pieces.values())) if mesh is not None else [t for _, t in pieces.values()]
    state = {k: sharded(module, mesh, name, t) for (k, (name, _)), t in zip(pieces.items(), whole)}
    dcp.save({**state, **plain}, checkpoint_id=str(path), process_group=module.process_group)
    if not dist.is_initialized() or dist.get_rank() == 0:  # the module's ranks are 0 .. runtime_ngpus-1
        Path(path, META).write_text(json.dumps(meta, indent=1))
    if dist.is_initialized():
        dist.barrier(group=module.process_group)


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


def check_optimizer(meta: dict, optimizer: torch.optim.Optimizer, names: list[str]) -> None:
    """The checkpoint's optimizer state fits ``optimizer`` (same kind); errors name the parameter."""
    saved = meta.get("optimizer")
    if saved is None:
        raise CheckpointError("the checkpoint holds no optimizer state; save it with save(path, module, optimizer)")
    for name in names:
        keys = meta["state_keys"].get(name)
        if keys is None:
            raise CheckpointError(f"parameter {name}: the checkpoint holds no optimizer state for it")
        if saved != type(optimizer).__name__:
            raise CheckpointError(f"parameter {name}: the checkpoint holds {saved} state ({', '.join(keys)}), "
                                  f"which a {type(optimizer).__name__} cannot resume from")


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


def load(path: str | Path, module: "ParallelModule", optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a checkpoint written by :func:`save` under any plan into ``module`` (and ``optimizer``,
    built over ``module.parameters()``); each rank reads only what its pieces overlap."""
    if hasattr(module, "stages"):  # a pipeline: nnscaler.pipeline.checkpoint, in this format
        from ..pipeline.checkpoint import load as load_pipeline
        return load_pipeline(path, module, optimizer)
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
    if optimizer is not None:
        pnames = _param_names(module)
        opt_state = optimizer_targets(held, meta, optimizer, lambda p: (module, mesh, pnames[id(p)]), state)
    dcp.load(state, checkpoint_id=str(path), process_group=module.process_group)
    with torch.no_grad():
        for dest, buf, cut in targets:
            dest.copy_(cut(buf))
    if optimizer is not None:
        restore_optimizer(optimizer, meta, opt_state)
