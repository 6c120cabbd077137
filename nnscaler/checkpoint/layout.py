"""A rank's pieces of the model's tensors as ``DTensor``s: ``torch.distributed.checkpoint`` then
records each piece's offset in the whole tensor and reshards on load, so no rank ever holds more
than its own shard. A plan's layout per mesh axis (``D<dim>`` split, ``R`` whole) is exactly a
``DTensor`` placement; two axes splitting one dim nest axis 0 outside, as ``DTensor`` does."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

if TYPE_CHECKING:
    from ..runtime.module import ParallelModule


def device_mesh(module: "ParallelModule") -> DeviceMesh | None:
    """The plan's rank mesh as a ``DeviceMesh`` over the module's existing groups (no new groups)."""
    mesh = module._mesh
    axes = _axes(module)
    if not axes:
        return None
    ranks = torch.arange(mesh.offset, mesh.offset + int(torch.tensor(mesh.shape).prod())).reshape(mesh.shape)
    ranks = ranks[tuple(slice(None) if a in axes else 0 for a in range(len(mesh.shape)))]  # axes of one rank go
    device = "cuda" if torch.cuda.is_available() else "cpu"
    groups = [mesh.groups[a] for a in axes]
    if len(groups) == 1:
        return DeviceMesh.from_group(groups[0], device, mesh=ranks)
    return DeviceMesh.from_group(groups, device, mesh=ranks, mesh_dim_names=tuple(f"axis{i}" for i in range(len(groups))))


def _axes(module: "ParallelModule") -> list[int]:
    """Mesh axes of more than one rank (a DeviceMesh has no use for the others)."""
    return [a for a, n in enumerate(module._mesh.shape) if n > 1]


def placements(layout, axes: list[int]) -> list:
    return [Shard(int(layout[a][1:])) if layout[a].startswith("D") else Replicate() for a in axes]


def sharded(module: "ParallelModule", mesh: DeviceMesh | None, name: str, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's piece of model tensor ``name``, or of a tensor laid out like it) as a
    ``DTensor`` of the whole shape; a plain tensor when the plan has one rank."""
    shape, layout, _, _ = module._program.STATE[name]
    if mesh is None:
        return local
    full = torch.Size(shape)
    stride = torch.empty(full, device="meta").stride()
    return DTensor.from_local(local, mesh, placements(layout, _axes(module)), run_check=False, shape=full,
                              stride=stride)
