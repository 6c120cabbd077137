"""The persistent rank gang: W real processes in one process group, reused for many cases.

Starting a process group costs seconds here while a case costs milliseconds, so ranks are started
once and fed jobs through queues. The parent polls rank liveness while it waits: a rank that dies or
a case that passes its time limit becomes a failed result, and the gang is restarted before the next
job. A rank that raises answers with the error and stays usable.
"""
from __future__ import annotations

import itertools
import queue
import socket
import time
from dataclasses import dataclass
from typing import Sequence

import torch.multiprocessing as mp

from . import worker


class GangError(RuntimeError):
    """The gang could not start (every rank reports why, or none answered)."""


@dataclass
class RankAnswer:
    """One rank's answer to a job; ``failure`` is set when the rank gave none (timeout, crash)."""

    rank: int
    result: dict | None = None
    failure: str | None = None
    kind: str | None = None  # "timeout" | "crash" when failure is set


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gang:
    """``size`` ranks serving jobs for every world size in ``world_sizes`` (each <= size).

    Ranks are forked from a ``forkserver`` that imported torch once (about 0.5 s for a restart here,
    against seconds for fresh interpreters); ``start_method="spawn"`` gives fresh interpreters, as
    ``torchrun`` does."""

    def __init__(self, size: int, modules: Sequence[str] = (), world_sizes: Sequence[int] | None = None,
                 pg_timeout_s: float = 30.0, start_timeout_s: float = 120.0, start_method: str = "forkserver"):
        self.size = size
        self.start_method = start_method
        self.modules = list(modules)
        self.world_sizes = sorted(set(world_sizes or [size]))
        if max(self.world_sizes) > size:
            raise ValueError(f"world size {max(self.world_sizes)} is larger than the gang ({size} ranks)")
        self.pg_timeout_s = pg_timeout_s
        self.start_timeout_s = start_timeout_s
        self.starts = 0
        self._ids = itertools.count()
        self._procs: list = []
        self._inboxes: list = []
        self._outbox = None
        self._healthy = False

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":  # ranks fork from a server that imported torch once
            ctx.set_forkserver_preload(["torch", "torch.distributed", "verify.worker", "opzoo"])
        last_error = None
        for _attempt in range(3):  # a port taken between choosing and binding: try another
            port = free_port()
            self._outbox = ctx.Queue()
            self._inboxes = [ctx.Queue() for _ in range(self.size)]
            self._procs = [ctx.Process(target=worker.main, daemon=True,
                                       args=(r, self.size, port, self._inboxes[r], self._outbox, self.modules,
                                             self.world_sizes, self.pg_timeout_s))
                           for r in range(self.size)]
            for p in self._procs:
                p.start()
            try:
                self._await_ready()
                self._healthy = True
                self.starts += 1
                return
            except GangError as exc:
                last_error = exc
                self.stop()
                if "address already in use" not in str(exc).lower():
                    break
        raise last_error

    def _await_ready(self) -> None:
        ready: dict[int, dict] = {}
        deadline = time.monotonic() + self.start_timeout_s
        while len(ready) < self.size:
            try:
                tag, rank, info = self._outbox.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in ready]
                if dead:
                    raise GangError(f"rank {dead[0]} exited with code {self._procs[dead[0]].exitcode} while starting")
                if time.monotonic() > deadline:
                    raise GangError(f"ranks {sorted(set(range(self.size)) - set(ready))} did not start "
                                    f"within {self.start_timeout_s:.0f} s")
                continue
            if tag == "ready":
                if info.get("error"):
                    raise GangError(f"rank {rank} failed to start: {info['error']}")
                ready[rank] = info

    def stop(self) -> None:
        """Ask the ranks to finish, then kill whatever is left."""
        for box, p in zip(self._inboxes, self._procs):
            if p.is_alive():
                try:
                    box.put(None)
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + (2.0 if self._healthy else 0.0)
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for q in self._inboxes + ([self._outbox] if self._outbox is not None else []):
            q.cancel_join_thread()
            q.close()
        self._procs, self._inboxes, self._outbox, self._healthy = [], [], None, False

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> "Gang":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- jobs --------------------------------------------------------------------------------------
    def run(self, job: dict, ranks: int, timeout_s: float) -> list[RankAnswer]:
        """Send ``job`` to ranks ``0 .. ranks-1`` and collect one answer each.

        Never raises for a misbehaving case: ranks that die or stay silent past ``timeout_s`` (after
        the first answer, a failing rank's peers get a short grace) are reported as failures, and the
        gang is restarted before the next job.
        """
        if not self._healthy:
            self.restart()
        job = dict(job, id=next(self._ids))
        for r in range(ranks):
            self._inboxes[r].put(job)
        answers: dict[int, RankAnswer] = {}
        deadline = time.monotonic() + timeout_s
        while len(answers) < ranks:
            try:
                tag, rank, result = self._outbox.get(timeout=0.05)
            except queue.Empty:
                now = time.monotonic()
                for r in range(ranks):
                    if r not in answers and not self._procs[r].is_alive():
                        answers[r] = RankAnswer(r, failure=f"rank {r} died (exit code {self._procs[r].exitcode})",
                                                kind="crash")
                if now > deadline and len(answers) < ranks:
                    for r in range(ranks):
                        answers.setdefault(r, RankAnswer(r, failure=f"rank {r} gave no answer within {timeout_s:.0f} s",
                                                         kind="timeout"))
                continue
            if tag != job["id"]:
                continue  # a late answer to an earlier job
            answers[rank] = RankAnswer(rank, result=result)
            if result.get("error"):
                deadline = min(deadline, time.monotonic() + 3.0)  # peers may be stuck in a collective
        if any(a.failure for a in answers.values()):
            self._healthy = False  # some rank may be dead or stuck in a collective
        return [answers[r] for r in range(ranks)]
