"""The persistent rank gang: W real processes in one process group, reused for many cases.

Starting a process group costs seconds here while a case costs milliseconds, so ranks are started
once and fed jobs through queues. The parent polls rank liveness and memory while it waits:

* the harness decides, never gloo: the process group's own timeout (``PG_TIMEOUT_S``) is a ceiling
  far above any case limit, so a one-sided collective ends as this gang's timeout, not as a gloo
  error that leaves a peer's collective pending for the next case;
* a rank that dies, stays silent past the case's limit, or grows past ``memory_mb`` becomes a failed
  answer; a rank that raises answers with its error. After any of these in a multi-rank case (a
  collective may be pending), and whenever a rank ends a job above the memory cap, the gang is
  restarted before the next job;
* rendezvous is a TCP store the parent hosts on a socket it bound itself to ``host`` (loopback by
  default; torch's own store listens on every interface), and gloo's sockets use the loopback
  interface;
* ranks die with the harness (see :mod:`verify.runner.isolation`), and the whole process tree of a rank is
  killed with it.
"""
from __future__ import annotations

import datetime
import itertools
import os
import queue
import socket
import time
from dataclasses import dataclass
from typing import Sequence

import torch.distributed as dist
import torch.multiprocessing as mp

from verify.runner import worker
from verify.runner import isolation
from verify.runner.rank_logs import RankLogs
from verify.judge.answer import RankAnswer
from verify.runner.limits import DEFAULT_MEMORY_MB, max_ranks  # noqa: F401  (the gang's own checks; re-exported)

PG_TIMEOUT_S = 3600.0  # gloo's own timeout: only a backstop, case limits are far shorter
ERROR_GRACE_S = 3.0  # after one rank's error, how long its peers get to answer


class GangError(RuntimeError):
    """The gang could not start (every rank reports why, or none answered)."""


class MemoryCapError(ValueError):
    """``memory_mb`` is below what a bare rank holds before any case: every case would be killed."""


class WorldSizeError(ValueError):
    """More ranks than this machine can run."""


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on ``host`` (the loopback interface by default)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def host_store(host: str = "127.0.0.1", timeout_s: float = 300.0, port: int = 0) -> tuple[dist.TCPStore, socket.socket]:
    """A TCP store server listening on ``host`` only (torch binds its own to every interface), on
    ``port`` (0: any free one); keep the returned socket open as long as the store is used."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(256)
    store = dist.TCPStore(host, sock.getsockname()[1], None, True, datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=sock.fileno())
    return store, sock


class Gang:
    """``size`` ranks serving jobs for every world size in ``world_sizes`` (each <= size).

    Ranks are forked from a ``forkserver`` that imported torch once (about 0.5 s for a restart here,
    against seconds for fresh interpreters); ``start_method="spawn"`` gives fresh interpreters, as
    ``torchrun`` does. Raises ``WorldSizeError`` for more ranks than :func:`max_ranks`."""

    def __init__(self, size: int, modules: Sequence[str] = (), world_sizes: Sequence[int] | None = None,
                 pg_timeout_s: float = PG_TIMEOUT_S, start_timeout_s: float = 120.0, start_method: str = "forkserver",
                 host: str = "127.0.0.1", memory_mb: float = DEFAULT_MEMORY_MB):
        if size > max_ranks():
            raise WorldSizeError(f"{size} ranks is more than this machine can run ({os.cpu_count()} cores, at most "
                             f"{max_ranks()} ranks): use a world size of at most {max_ranks()}")
        self.size = size
        self.start_method = start_method
        self.modules = list(modules)
        self.world_sizes = sorted(set(world_sizes or [size]))
        if max(self.world_sizes) > size:
            raise ValueError(f"world size {max(self.world_sizes)} is larger than the gang ({size} ranks)")
        self.pg_timeout_s = pg_timeout_s
        self.start_timeout_s = start_timeout_s
        self.host = host
        self.memory_mb = memory_mb
        self.starts = 0
        self._ids = itertools.count()
        self._procs: list = []
        self._inboxes: list = []
        self._outbox = None
        self._store = self._sock = None
        self._logs: RankLogs | None = None
        self._healthy = False

    @property
    def pids(self) -> list[int]:
        """Process ids of the running ranks."""
        return [p.pid for p in self._procs]

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":  # ranks fork from a server that imported torch once
            ctx.set_forkserver_preload(["verify.runner.forkserver_guard", "torch", "torch.distributed", "verify.runner.worker", "opzoo"])
        self._store, self._sock = host_store(self.host, self.start_timeout_s)
        port = self._sock.getsockname()[1]
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.size)]
        self._logs = RankLogs(self.size)
        self._procs = [ctx.Process(target=worker.main, daemon=True,
                                   args=(r, self.size, (self.host, port), self._inboxes[r], self._outbox,
                                         self.modules, self.world_sizes, self.pg_timeout_s, os.getpid(),
                                         (self._logs.stderr_path(r), self._logs.crumb_path(r))))
                       for r in range(self.size)]
        for p in self._procs:
            p.start()
        try:
            self._await_ready()
        except GangError:
            self.stop()
            raise
        bare = max(rss_tree_mb(p.pid) for p in self._procs)  # before any case: torch, gloo, the catalogue
        if bare > self.memory_mb:
            self.stop()
            raise MemoryCapError(f"--rank-memory {self.memory_mb:.0f} MiB is below what a bare rank holds before "
                                 f"any case ({bare:.0f} MiB measured); give at least {2 * bare:.0f}")
        self._healthy = True
        self.starts += 1

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
        """Ask the ranks to finish, then kill whatever is left, with every process they started."""
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
                isolation.kill_tree(p.pid, include_self=True)
                p.join(timeout=5)
        for q in self._inboxes + ([self._outbox] if self._outbox is not None else []):
            q.cancel_join_thread()
            q.close()
        if self._sock is not None:
            self._sock.close()
        if self._logs is not None:
            self._logs.close()
        self._procs, self._inboxes, self._outbox, self._healthy, self._logs = [], [], None, False, None
        self._store = self._sock = None

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

        Never raises for a misbehaving case: ranks that die, stay silent past ``timeout_s`` or grow
        past the memory cap are failed answers (after one rank's error, its peers get
        ``ERROR_GRACE_S``), and the gang is restarted before the next job. A rank killed by a signal
        (a segfault of a long-lived rank, seen once in hundreds of CI cases and never again alone)
        gets the case once more on a fresh gang; a case that crashes its rank itself crashes again
        and is reported, saying it was run twice.
        """
        if not timeout_s > 0 or timeout_s >= self.pg_timeout_s:
            raise ValueError(f"case limit {timeout_s} s must be positive and below the process group's "
                             f"timeout ({self.pg_timeout_s:.0f} s)")
        answers = self._run_once(job, ranks, timeout_s)
        if not any(a.kind == "crash" and (a.exit_code or 0) < 0 for a in answers):
            return answers
        answers = self._run_once(job, ranks, timeout_s)
        for a in answers:
            if a.failure:
                a.failure += " (on a fresh gang too: the case was run twice)"
        return answers

    def _run_once(self, job: dict, ranks: int, timeout_s: float) -> list[RankAnswer]:
        if not self._healthy:
            self.restart()
        job = dict(job, id=next(self._ids))
        for r in range(ranks):
            self._logs.mark(r)
            self._inboxes[r].put(job)
        answers: dict[int, RankAnswer] = {}
        start = time.monotonic()
        deadline, first_error, next_poll = start + timeout_s, None, start
        while len(answers) < ranks:
            try:
                tag, rank, result = self._outbox.get(timeout=0.05)
            except queue.Empty:
                now = time.monotonic()
                if now >= next_poll:
                    next_poll = now + 0.25
                    self._logs.echo()
                    self._poll(ranks, answers)
                if now > deadline:
                    for r in range(ranks):
                        if r in answers:
                            continue
                        if first_error is not None:
                            answers[r] = RankAnswer(r, failure=f"rank {r} gave no answer {ERROR_GRACE_S:.0f} s after "
                                                    f"rank {first_error}'s error", kind="peer")
                        else:
                            where = self._logs.where(r)
                            answers[r] = RankAnswer(r, kind="timeout", failure=f"rank {r} gave no answer within the "
                                                    f"limit of {timeout_s:.0f} s (waited {now - start:.1f} s"
                                                    + (f"; last in {where})" if where else ")"))
                continue
            if tag != job["id"]:
                continue  # a late answer to an earlier job
            answers[rank] = RankAnswer(rank, result=result)
            if result.get("error") and first_error is None:
                first_error = rank
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)  # peers may be stuck in a collective
        failed = any(a.failure for a in answers.values())
        errored = any(a.result and a.result.get("error") and a.result.get("error_type") != "StateLeak"
                      for a in answers.values())  # raised mid-case; a leak is found after a finished case
        if failed or (errored and ranks > 1) or self._over_memory():
            self._healthy = False  # a rank may be dead, stuck in a collective or bloated: restart
        return [answers[r] for r in range(ranks)]

    def _poll(self, ranks: int, answers: dict[int, RankAnswer]) -> None:
        for r in range(ranks):
            if r in answers:
                continue
            p = self._procs[r]
            if not p.is_alive():
                said = self._logs.last_words(r)
                answers[r] = RankAnswer(r, failure=f"rank {r} died (exit code {p.exitcode})" + (f": {said}" if said else ""),
                                        kind="crash", exit_code=p.exitcode)
                continue
            mb = rss_tree_mb(p.pid)
            if mb > self.memory_mb:
                isolation.kill_tree(p.pid, include_self=True)
                answers[r] = RankAnswer(r, kind="memory", failure=f"rank {r} used {mb:.0f} MiB, over the limit of "
                                        f"{self.memory_mb:.0f} MiB per rank (raise it with --rank-memory)")

    def _over_memory(self) -> bool:
        return any(rss_tree_mb(p.pid) > self.memory_mb for p in self._procs)


def rss_tree_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants, in MiB."""
    return isolation.rss_mb(pid) + sum(isolation.rss_mb(c) for c in isolation.descendants(pid))
