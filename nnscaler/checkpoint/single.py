"""One device: a merged single-file export of a sharded checkpoint (``torch.save`` of tensors and
plain values only, read back with ``weights_only=True``), and loading either form into a plain
single-device model and its optimizer."""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from .format import CheckpointError, check_optimizer, read_meta


def export_merged(path: str | Path, out_file: str | Path) -> None:
    """Merge the sharded checkpoint in directory ``path`` into one file ``out_file`` (no process
    group needed): ``{"tensors": {key: whole tensor}, "meta": nnscaler.json}``."""
    _, meta = read_meta(path)
    with tempfile.TemporaryDirectory() as tmp:
        flat = Path(tmp) / "flat.pt"
        dcp_to_torch_save(str(path), str(flat))
        tensors = torch.load(flat, weights_only=True)
    torch.save({"tensors": tensors, "meta": meta}, out_file)


def load_merged(file: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors, meta)`` of a merged file, loaded with ``weights_only=True``."""
    data = torch.load(file, weights_only=True)
    if not isinstance(data, dict) or "tensors" not in data or "meta" not in data:
        raise CheckpointError(f"{file} is not a merged nnscaler checkpoint; write one with export_merged")
    return data["tensors"], data["meta"]


def load_single(source: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a merged file (or a sharded checkpoint directory) into a single-device ``model`` and
    ``optimizer`` (built over ``model.parameters()``)."""
    source = Path(source)
    if source.is_dir():
        with tempfile.TemporaryDirectory() as tmp:
            export_merged(source, Path(tmp) / "merged.pt")
            tensors, meta = load_merged(Path(tmp) / "merged.pt")
    else:
        tensors, meta = load_merged(source)
    params = dict(model.named_parameters())
    whole = {**dict(model.named_buffers()), **params}
    held = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    missing, unexpected = sorted(set(params) - set(held)), sorted(set(held) - set(whole))
    if missing or unexpected:
        raise CheckpointError(f"the checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, value in held.items():  # every parameter, and the buffers the program used
            if tuple(value.shape) != tuple(whole[name].shape):
                raise CheckpointError(f"{name}: the checkpoint holds shape {tuple(value.shape)}, the model has "
                                      f"{tuple(whole[name].shape)}")
            whole[name].copy_(value)
    if optimizer is None:
        return
    names = {id(p): n for n, p in params.items()}
    order = [p for g in optimizer.param_groups for p in g["params"]]
    check_optimizer(meta, optimizer, [names[id(p)] for p in order])
    for gi, group in enumerate(optimizer.param_groups):
        saved = meta["param_groups"][gi] if gi < len(meta["param_groups"]) else {}
        group.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items() if k in group})
    for p in order:
        name = names[id(p)]
        optimizer.state[p] = {k: tensors[f"optim.{name}.{k}"].clone() for k in meta["state_keys"][name]}
