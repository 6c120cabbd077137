"""The process groups a compiled module runs on: the default group (made from the ``torchrun``
environment when there is none), checked against the config, and the replica groups."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..config import ComputeConfig, PlanError
from ..runtime.mesh import GroupCache


def ensure_process_group(config: ComputeConfig, groups: GroupCache | None) -> tuple[int, int, int]:
    """``(world, rank, runtime ranks)`` of the default process group, made from the ``torchrun``
    environment if none exists; raises :class:`PlanError` when it does not hold the config's ranks."""
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RuntimeError("parallelize needs a process group: launch with torchrun, or call "
                               "torch.distributed.init_process_group first")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    runtime = config.runtime_ngpus or config.plan_ngpus
    if world != runtime and not (groups is not None and runtime <= world):
        raise PlanError(f"the process group has {world} ranks but the config asks for {runtime} "
                        f"(runtime_ngpus, or plan_ngpus when runtime_ngpus is unset)")
    return world, rank, runtime


def module_group(cache: GroupCache, runtime: int, world: int):
    """The group of every rank of the module (``None``: the default group is exactly those)."""
    return None if runtime == world else cache.get(list(range(runtime)))


def replica_group(cache: GroupCache, ranks: list[int], create: bool):
    """The group of one plan rank's replicas: from ``cache`` when made beforehand, else a new one
    (``new_group`` is collective: every rank creates every replica group, in order)."""
    try:
        return cache.get(ranks)
    except KeyError:
        if not create:
            raise
        return dist.new_group(ranks)
