"""The ``DeviceMesh`` of a torch-parallelization case, the batch slice of each rank, and whole
tensors from what a rank holds (a DTensor, or a plain local tensor that is a piece of one).

The mesh is laid over the gang's own process groups (``DeviceMesh.from_group``): a case at W=2 runs on
ranks 0-1 of a larger gang, where ``init_device_mesh`` would call ``new_group`` on every rank of the
default group and hang (``new_group`` is collective over the whole world)."""
from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist
import torch.distributed.device_mesh as device_mesh
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from nnscaler.dimops.partition import axis_groups
from nnscaler.runtime.mesh import GroupCache

DP = "dp"  # the mesh dimension the harness splits the batch over
DATA = (DP, "dp_replicate", "dp_shard")  # all split the batch (torchtitan's HSDP names), over their ranks in mesh order
MAX_MESH_DIMS = 4
CP = "cp"  # context parallelism: each rank's loss covers its own sequence chunks (verify/cases/torchpar/ring_cpu.py)
MAX_DIMS = 8  # of a plain tensor gathered by :func:`whole`


class MeshSpecError(ValueError):
    """``--mesh`` is malformed or does not fit the world size (exit 2 before ranks start)."""


def parse_mesh(text: str) -> tuple[tuple[str, int | None], ...]:
    """``"tp"`` -> ``(("tp", None),)`` (the whole world); ``"dp=2,tp=2"`` -> ``(("dp", 2), ("tp", 2))``."""
    dims = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:=\s*(\d+))?\s*", part)
        if not m:
            raise MeshSpecError(f"--mesh {text!r}: {part!r} is not NAME or NAME=SIZE (e.g. tp, dp=2,tp=2)")
        dims.append((m.group(1), None if m.group(2) is None else int(m.group(2))))
    names = [n for n, _ in dims]
    if len(set(names)) != len(names):
        raise MeshSpecError(f"--mesh {text!r}: a dimension name repeats")
    if len(dims) > MAX_MESH_DIMS:
        raise MeshSpecError(f"--mesh {text!r}: at most {MAX_MESH_DIMS} dimensions (e.g. dp_replicate=2,dp_shard=2,tp=2)")
    if len(dims) == 2 and any(s is None for _, s in dims):
        raise MeshSpecError(f"--mesh {text!r}: give both sizes of a 2-D mesh (e.g. dp=2,tp=2)")
    if len(dims) > 2 and any(s is None for _, s in dims):
        raise MeshSpecError(f"--mesh {text!r}: give every size of a {len(dims)}-D mesh (e.g. dp_replicate=2,dp_shard=2,tp=2)")
    if any(s is not None and s < 1 for _, s in dims):
        raise MeshSpecError(f"--mesh {text!r}: sizes must be at least 1")
    return tuple(dims)


def mesh_shape(dims, world_size: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Names and sizes of the mesh at ``world_size``; :class:`MeshSpecError` when they do not multiply to it."""
    names = tuple(n for n, _ in dims)
    sizes = tuple(world_size if s is None else s for _, s in dims)
    if math.prod(sizes) != world_size:
        spec = ",".join(f"{n}={s}" for n, s in zip(names, sizes))
        raise MeshSpecError(f"--mesh {spec} has {math.prod(sizes)} ranks but the world size is {world_size}; "
                            f"give --world-size {math.prod(sizes)} or another --mesh")
    return names, sizes


def build_mesh(names: tuple[str, ...], sizes: tuple[int, ...], groups: GroupCache, device_type: str = "cpu") -> DeviceMesh:
    """The mesh over ranks ``0 .. prod(sizes)-1`` (row-major, as :func:`axis_groups` lays them),
    from the groups the gang created at start; a size-1 dimension's one-rank group as the mesh code's
    ``new_group`` gives it (inside :func:`verify.cases.torchpar.gang_mesh.gang_groups`: made locally)."""
    rank = dist.get_rank()
    mine = []
    for axis in axis_groups(sizes):
        g = next(g for g in axis if rank in g)
        mine.append(groups.get(g) if len(g) > 1 else device_mesh.new_group(ranks=list(g)))
    ranks = torch.arange(math.prod(sizes)).view(*sizes)
    return DeviceMesh.from_group(mine if len(mine) > 1 else mine[0], device_type, mesh=ranks, mesh_dim_names=names)


def data_axes(mesh: DeviceMesh) -> list[str]:
    """The mesh dimensions that split the batch (:data:`DATA`), in mesh order."""
    return [n for n in (mesh.mesh_dim_names or ()) if n in DATA]


def dp_slice(args: tuple, mesh: DeviceMesh) -> tuple:
    """This rank's slice of the batch: dim 0 of every tensor split over the data dimensions (``dp``, or
    torchtitan's ``dp_replicate`` x ``dp_shard``: one slice per coordinate, row-major in mesh order)."""
    axes = data_axes(mesh)
    if not axes:
        return args
    n, i = data_slices(mesh)
    return batch_rows(args, n, i)


def data_slices(mesh: DeviceMesh) -> tuple[int, int]:
    """How many slices the data dimensions cut the batch into, and this rank's (row-major in mesh order)."""
    n, i = 1, 0
    for axis in data_axes(mesh):
        n, i = n * mesh[axis].size(), i * mesh[axis].size() + mesh[axis].get_local_rank()
    return n, i


def batch_rows(args: tuple, n: int, i: int) -> tuple:
    """The ``i``-th of ``n`` equal slices of the batch: dim 0 of every tensor."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim():
            if a.shape[0] % n:
                raise ValueError(f"the batch ({a.shape[0]} rows) does not divide into {n} slices over the data dimensions")
            a = a.chunk(n)[i]
        out.append(a)
    return tuple(out)


def loss_axes(mesh: DeviceMesh) -> list[str]:
    """The mesh dimensions whose ranks each hold part of the step's tokens: the step's loss is the mean
    of their losses (``dp`` splits the rows, ``cp`` the sequence; equal shares by construction)."""
    return [n for n in (mesh.mesh_dim_names or ()) if (n in DATA or n == CP) and mesh[n].size() > 1]


def token_degree(mesh: DeviceMesh) -> int:
    """How many ranks split the step's tokens (the product of :func:`loss_axes`)."""
    return math.prod(mesh[n].size() for n in loss_axes(mesh))


def describe(x) -> str:
    """A tensor's layout in words: ``Shard(dim=0) on tp``, ``plain``."""
    if isinstance(x, DTensor):
        names = x.device_mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(x.device_mesh.ndim))
        return ", ".join(f"{p} on {n}" for p, n in zip(x.placements, names))
    return "plain"


def whole(x: torch.Tensor, want_shape, mesh: DeviceMesh) -> tuple[torch.Tensor | None, str]:
    """The whole tensor this rank's ``x`` is part of, and its layout in words. A DTensor: its
    ``full_tensor()``. A plain tensor (a parallel style's local output): as is where its shape is
    ``want_shape``; else, over each mesh dimension but ``dp`` in turn, gathered along the first dimension whose
    pieces there add up to its length (the ranks agree on every step: each exchanges its shape first).
    ``None`` where no such gather exists. Collective: every rank of the mesh calls it in the same order."""
    if isinstance(x, DTensor):
        return x.full_tensor(), describe(x)
    how, want = [], tuple(want_shape)
    for d, name in enumerate(mesh.mesh_dim_names):
        group, n = mesh.get_group(d), mesh.size(d)
        if n == 1 or name in DATA:  # each dp rank holds its own rows, compared with one device on the same rows
            continue
        mine = torch.tensor([x.dim(), *x.shape] + [0] * (MAX_DIMS - x.dim())) if x.dim() <= MAX_DIMS else \
            torch.full((MAX_DIMS + 1,), -1)
        gathered = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(gathered, mine, group=group)  # decided from what every member holds: all agree
        shapes = [tuple(int(v) for v in s[1:1 + int(s[0])]) if int(s[0]) >= 0 else None for s in gathered]
        if any(s is None or len(s) != len(want) for s in shapes) or all(s == want for s in shapes):
            continue
        fits = [i for i in range(len(want)) if any(s[i] != want[i] for s in shapes)
                and sum(s[i] for s in shapes) == want[i]]  # the first dim whose pieces add up (the batch under dp)
        if not fits:
            continue
        d0 = fits[0]
        size = max(s[d0] for s in shapes)
        pad = torch.zeros(*x.shape[:d0], size, *x.shape[d0 + 1:], dtype=x.dtype)
        pad.narrow(d0, 0, x.shape[d0]).copy_(x.detach())
        parts = [torch.empty_like(pad) for _ in range(n)]
        dist.all_gather(parts, pad, group=group)
        x = torch.cat([p.narrow(d0, 0, s[d0]) for p, s in zip(parts, shapes)], dim=d0)
        how.append(f"local piece along dim {d0} over {name}")
    if tuple(x.shape) != want:
        return None, f"plain, shape {tuple(x.shape)}"
    return x, "; ".join(how) or "plain"
