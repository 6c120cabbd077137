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
    if not mesh.shape:
        return None
    ranks = torch.arange(mesh.offset, mesh.offset + int(torch.tensor(mesh.shape).prod())).reshape(mesh.shape)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    groups = list(mesh.groups)
    return DeviceMesh.from_group(groups if len(groups) > 1 else groups[0], device, mesh=ranks)


def placements(layout) -> list:
    return [Shard(int(q[1:])) if q.startswith("D") else Replicate() for q in layout]


def sharded(module: "ParallelModule", mesh: DeviceMesh | None, name: str, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's piece of model tensor ``name``, or of a tensor laid out like it) as a
    ``DTensor`` of the whole shape; a plain tensor when the plan has one rank."""
    shape, layout, _, _ = module._program.STATE[name]
    if mesh is None:
        return local
    full = torch.Size(shape)
    stride = torch.empty(full, device="meta").stride()
    return DTensor.from_local(local, mesh, placements(layout), run_check=False, shape=full, stride=stride)
