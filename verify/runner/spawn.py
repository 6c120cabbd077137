"""One function on ``world`` fresh processes joined in a gloo group on loopback: the start-up the
benchmarks and rank tests that drive ``torch.distributed`` themselves share (the harness's own cases
run on a :class:`verify.runner.gang.Gang`, which keeps its ranks for many jobs).

    results = run_ranks(fn, 4, args)   # fn(rank, world, args) on each rank -> {rank: its return value}

``torch.multiprocessing``'s spawn gives fresh interpreters, as ``torchrun`` does; ``fn`` must be a
module-level function (a script's own ``__main__`` functions are fine).
"""
from __future__ import annotations

import datetime
import os
import queue
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .gang import free_port


class RanksError(RuntimeError):
    """A rank raised, or no answer came within the time limit."""


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 600.0) -> dict[int, Any]:
    """``fn(rank, world, *args)`` on ``world`` ranks of a fresh gloo group (one thread each, bound to
    127.0.0.1, collectives time out after ``timeout_s``); every rank's return value, by rank. A rank
    that raises ends the run with :class:`RanksError` naming it."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = mp.start_processes(_entry, args=(fn, world, free_port(), timeout_s, args, out), nprocs=world,
                               start_method="spawn", join=False)
    results: dict[int, Any] = {}
    try:
        while len(results) < world:
            try:
                rank, ok, value = out.get(timeout=timeout_s)
            except queue.Empty:
                raise RanksError(f"{world - len(results)} of {world} ranks gave no answer in {timeout_s:g} s") from None
            if not ok:
                raise RanksError(f"rank {rank}: {value}")
            results[rank] = value
        while not procs.join():
            pass
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
    return results


def _entry(rank: int, fn, world: int, port: int, timeout_s: float, args: tuple, out) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        out.put((rank, True, fn(rank, world, *args)))
    except Exception as e:  # noqa: BLE001  (reported to the parent, which stops the run)
        out.put((rank, False, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()
