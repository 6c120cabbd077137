"""Verify a plan's (operator, partition) pairs when there is no process group to run them on
(``plan_model(..., verify=...)``): a local gang of ``plan.world_size`` ranks is launched for the
occasion, on the loopback interface, and runs :func:`verify.plan.check.verify_plan` exactly as the
ranks of a ``torchrun`` job do.

The ranks are *forked*: they inherit the traced graph, the plan and every operator registered in
this process (a user's custom ops included), none of which can be sent to a fresh interpreter
(operators hold functions). A fully cached plan launches nothing.
"""
from __future__ import annotations

import datetime
import os
import queue
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nnscaler.ir.graph import IRGraph
from nnscaler.ir.plan import Plan

from verify.runner import isolation
from verify.runner.gang import host_store, max_ranks
from verify.plan.check import DEFAULT_CACHE, PairVerdict, cached_verdicts

DEFAULT_TIMEOUT_S = 600.0


class OfflineVerificationError(RuntimeError):
    """The local gang could not verify the plan (too many ranks for this machine, a rank died, or
    the time limit passed)."""


def _rank_main(rank: int, world: int, addr: tuple[str, int], parent: int, graph: IRGraph, plan: Plan,
               cache_path: Path, dtype: str, seed: int, answers) -> None:
    from verify.plan.check import verify_plan
    isolation.bind_to_parent(parent)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(addr[0], addr[1], world, False, timeout=datetime.timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
        verdicts = verify_plan(graph, plan, rank=rank, cache_path=cache_path, dtype=dtype, seed=seed)
        answers.put((rank, verdicts if rank == 0 else [], ""))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001  (reported to the launcher, which fails loudly)
        answers.put((rank, None, f"{type(exc).__name__}: {exc}"))


def verify_offline(graph: IRGraph, plan: Plan, *, cache_path: str | os.PathLike | None = None,
                   dtype: str = "float32", seed: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S,
                   host: str = "127.0.0.1") -> list[PairVerdict]:
    """One verdict per pair of ``plan``: from the cache, or verified on a local gang of
    ``plan.world_size`` ranks launched for it. Raises :class:`OfflineVerificationError`."""
    path = Path(cache_path) if cache_path is not None else DEFAULT_CACHE
    done = cached_verdicts(graph, plan, path, dtype)
    if done is not None:
        return done
    world = plan.world_size
    if world > max_ranks():
        raise OfflineVerificationError(
            f"verifying a plan for {world} ranks needs {world} local ranks, more than this machine runs "
            f"({max_ranks()}); plan for fewer ranks, verify under torchrun, or pass verify=False")
    ctx = mp.get_context("fork")  # the ranks inherit the graph, the plan and the registry
    store, sock = host_store(host)
    answers = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world, (host, sock.getsockname()[1]), os.getpid(), graph, plan, path, dtype,
                               seed, answers)) for r in range(world)]
    try:
        for p in procs:
            p.start()
        got: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < world:
            try:
                rank, verdicts, error = answers.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and not p.is_alive() and p.exitcode]
                if dead:
                    raise OfflineVerificationError(f"verification rank {dead[0]} died "
                                                   f"(exit code {procs[dead[0]].exitcode})") from None
                if time.monotonic() > deadline:
                    raise OfflineVerificationError(f"verification did not finish in {timeout_s:.0f} s") from None
                continue
            if error:
                raise OfflineVerificationError(f"verification rank {rank} failed: {error.splitlines()[0]}")
            got[rank] = verdicts
        return got[0]
    finally:
        for p in procs:
            if p.is_alive():
                isolation.kill_tree(p.pid, include_self=True)
            p.join(timeout=5)
        answers.cancel_join_thread()
        answers.close()
        sock.close()  # before the store, which would close the same descriptor
        del store
