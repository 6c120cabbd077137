"""Meshes a user's program lays itself, built from the gang's own process groups for the length of a case.

torch's ``init_device_mesh`` and a mesh's ``_unflatten`` / ``_flatten`` (what torchtitan's ``ParallelDims``
calls to lay its ``pp, dp_replicate, dp_shard, cp, tp, ep`` meshes) create each dimension's groups with
``new_group``, which is collective over the whole default group: a W=2 case on ranks 0-1 of a larger gang
would hang there, and groups made on some ranks only would desynchronise the names of every later one.
Inside :func:`gang_groups` the mesh code's ``new_group`` answers from the groups the gang created at
start (every axis group of every mesh shape of its world sizes, so any row-major mesh over the case's
ranks, its merged dimensions included); a one-rank group is made locally (``use_local_synchronization``,
named by its rank: no other rank takes part) and destroyed when the case ends. Meshes laid for an
accelerator the rank does not have (torchtitan names ``cuda`` where no device is found) are laid on the
CPU the gang runs on."""
from __future__ import annotations

import contextlib
from typing import Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.device_mesh as device_mesh
from torch.distributed.device_mesh import DeviceMesh

from nnscaler.runtime.mesh import GroupCache


class MeshGroupError(RuntimeError):
    """A mesh asked for a group of ranks the gang has none of (not a row-major mesh over the case's ranks)."""


@contextlib.contextmanager
def cpu_meshes() -> Iterator[None]:
    """Within: a ``DeviceMesh`` laid for an accelerator this process does not have is laid on the CPU (the
    gang's ranks, and the fake process group of the checks before them, run there)."""
    init = DeviceMesh.__init__

    def on_this_device(self, device_type, *args, **kwargs):
        module = getattr(torch, str(device_type), None)
        if device_type != "cpu" and hasattr(module, "is_available") and not module.is_available():
            device_type = "cpu"
        init(self, device_type, *args, **kwargs)

    with mock.patch.object(DeviceMesh, "__init__", on_this_device):
        yield


@contextlib.contextmanager
def gang_groups(groups: GroupCache) -> Iterator[None]:
    """Within: meshes get their process groups from ``groups`` (and one-rank groups made locally), and a
    mesh laid for an absent accelerator is laid on the CPU."""
    singles: dict[int, object] = {}
    rank = dist.get_rank()
    made = device_mesh.new_group  # torch's own, for the one-rank groups

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, group_desc=None,
                  use_local_synchronization=False, **_):
        ranks = tuple(sorted(ranks)) if ranks is not None else tuple(range(dist.get_world_size()))
        if rank not in ranks:
            return dist.GroupMember.NON_GROUP_MEMBER
        if len(ranks) == 1:
            if rank not in singles:
                singles[rank] = made(ranks=[rank], timeout=timeout, use_local_synchronization=True,
                                     group_desc=group_desc)
            return singles[rank]
        try:
            return groups.get(ranks)
        except KeyError:
            raise MeshGroupError(f"a mesh asked for a process group of ranks {list(ranks)}, which the gang does not "
                                 f"hold (meshes are laid row-major over the case's ranks)") from None

    try:
        with mock.patch.object(device_mesh, "new_group", new_group), cpu_meshes():
            yield
    finally:
        for g in singles.values():
            dist.destroy_process_group(g)
