"""A rank's pieces of the model's tensors as ``DTensor``s: ``torch.distributed.checkpoint`` then
records each piece's offset in the whole tensor and reshards on load, so no rank gathers the
model: it holds its own shard (and, below, the whole of pieces split in blocks along their axis). A plan's layout per mesh axis (``D<dim>`` split, ``R`` whole) is exactly a
``DTensor`` placement; two axes splitting one dim nest axis 0 outside, as ``DTensor`` does.

A split in blocks (``D0/3``: this rank's chunk of each of the q, k and v blocks of a fused dim) is no
``DTensor`` placement: such a piece is gathered over its axis before saving (stored replicated on
that axis; :func:`gather_blocks`, a few collectives for all of them), and loaded whole on that axis and cut to this rank's blocks (:func:`load_buffer`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..runtime.mesh import backend_device

if TYPE_CHECKING:
    from ..runtime.module import ParallelModule


def device_mesh(module: "ParallelModule") -> DeviceMesh | None:
    """The plan's rank mesh as a ``DeviceMesh`` over the module's existing groups (no new groups)."""
    mesh = module.mesh
    axes = _axes(module)
    if not axes:
        return None
    keep = _axes(module)  # an axis of one rank (no group) is no DeviceMesh dim
    if not keep:
        return None
    ranks = torch.arange(mesh.offset, mesh.offset + int(torch.tensor(mesh.shape).prod())).reshape(
        tuple(mesh.shape[a] for a in keep))
    groups = [mesh.groups[a] for a in keep]
    device = backend_device(groups[0]).type
    if len(groups) == 1:
        return DeviceMesh.from_group(groups[0], device, mesh=ranks)
    # several groups: torch wants a name per mesh dim
    return DeviceMesh.from_group(groups, device, mesh=ranks, mesh_dim_names=tuple(f"axis{a}" for a in keep))


def _axes(module: "ParallelModule") -> list[int]:
    """The mesh axes with more than one rank."""
    return [a for a, g in enumerate(module.mesh.groups) if g is not None]


def placements(layout) -> list:
    """DTensor placements of a layout's text; a split in blocks is stored whole on its axis."""
    return [Shard(int(q[1:])) if q.startswith("D") and "/" not in q else Replicate() for q in layout]


def _blocked(layout) -> list[tuple[int, int, int]]:
    """(axis, dim, blocks) of every split in blocks of a layout's text."""
    out = []
    for axis, q in enumerate(layout):
        if q.startswith("D") and "/" in q:
            dim, blocks = q[1:].split("/")
            out.append((axis, int(dim), int(blocks)))
    return out


GATHER_BYTES = 2**20  # pieces gathered together in one collective: few collectives, little memory beyond the pieces


def gather_blocks(module: "ParallelModule", items: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Each ``(name, local)`` made whole along the axes that split ``name`` in blocks (stored
    replicated on those axes), with one all-gather per axis, dtype and ``GATHER_BYTES`` of pieces
    rather than one per tensor (:func:`nnscaler.runtime.merge.gather_joined`; every rank calls this
    with the same names in the same order)."""
    from ..runtime.merge import gather_joined
    out = [local for _, local in items]
    blocked = [_blocked(module._program.STATE[name][1]) for name, _ in items]
    for axis, group in enumerate(module.mesh.groups):
        todo = [(i, dim, blocks) for i, b in enumerate(blocked) for a, dim, blocks in b if a == axis]
        if group is None or not todo:
            continue
        whole = gather_joined([out[i] for i, _, _ in todo], [(dim, blocks) for _, dim, blocks in todo], group,
                              GATHER_BYTES)
        for (i, _, _), w in zip(todo, whole):
            out[i] = w
    return out


def load_buffer(module: "ParallelModule", name: str, like: torch.Tensor):
    """(buffer to load into, function cutting it to this rank's piece): the buffer is ``like``'s
    shape, made whole along the axes that split ``name`` in blocks."""
    layout = module._program.STATE[name][1]
    blocked = [(a, d, k) for a, d, k in _blocked(layout) if module.mesh.groups[a] is not None]
    if not blocked:
        return torch.empty_like(like), lambda buf: buf
    shape = list(like.shape)
    for axis, dim, _ in blocked:
        shape[dim] *= module.mesh.shape[axis]
    coords = module.mesh.coords

    def cut(buf: torch.Tensor) -> torch.Tensor:
        for axis, dim, blocks in blocked:
            f = module.mesh.shape[axis]
            buf = buf.unflatten(dim, (blocks, -1)).chunk(f, dim + 1)[coords[axis]].flatten(dim, dim + 1)
        return buf
    return torch.empty(shape, dtype=like.dtype, device=like.device), cut


def sharded(module: "ParallelModule", mesh: DeviceMesh | None, name: str, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's piece of model tensor ``name``, or of a tensor laid out like it, made
    whole along the axes that split it in blocks: :func:`gather_blocks`, :func:`load_buffer`) as a
    ``DTensor`` of the whole shape; a plain tensor when the plan has one rank."""
    shape, layout, _, _ = module._program.STATE[name]
    if mesh is None:
        return local
    full = torch.Size(shape)
    stride = torch.empty(full, device="meta").stride()
    places = placements(layout)
    return DTensor.from_local(local, mesh, [places[a] for a in _axes(module)], run_check=False, shape=full,
                              stride=stride)
