"""The ranks of a ``torchrun`` job in the place of the gang: rank 0 drives the run with the same code
that drives a :class:`~verify.runner.gang.Gang` (its ``run(job, ranks, timeout_s)``), every other rank
serves what rank 0 broadcasts until told to stop.

Each job is broadcast from rank 0 (``broadcast_object_list``), answered on every rank by
:func:`verify.runner.worker.isolated` (the gang's own answer, from the same :class:`~verify.runner.worker.RankState`)
and gathered on rank 0 (``gather_object``), which judges the answers as it judges a gang's. Unlike a
gang, a torchrun job cannot restart its ranks: a case past its limit ends the job (exit 1), since a
rank may be stuck in a collective that nothing can cancel.
"""
from __future__ import annotations

import datetime
import itertools
import os
import secrets
import socket
import sys
import threading
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from nnscaler.runtime.mesh import GroupCache, mesh_shapes

from verify.runner import worker
from verify.judge.answer import RankAnswer
from verify.runner.gang import PG_TIMEOUT_S, GangError

def join(timeout_s: float = PG_TIMEOUT_S) -> torch.device:
    """Join the process group torchrun's environment describes; returns this rank's device. With a GPU
    per local rank the backend is ``cpu:gloo,cuda:nccl`` (CUDA tensors over nccl, the CPU tensors of
    whole-model cases over gloo), else gloo."""
    local, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return torch.device("cuda", local) if cuda else torch.device("cpu")


class TorchrunRanks:
    """Every rank of the job, seen from rank 0 as a gang of ``size`` ranks (``with ranks: ranks.run(...)``);
    the other ranks call :meth:`serve`. ``modules``: the ``--module`` files every rank imports."""

    def __init__(self, device: torch.device, cwd: str, modules: Sequence[str] = ()):
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.device, self.cwd, self.modules = device, cwd, list(modules)
        self.multinode = int(os.environ.get("LOCAL_WORLD_SIZE", self.size)) != self.size
        self.starts = 0
        self.state: worker.RankState | None = None
        self._ids = itertools.count()
        self._closed = False

    # -- rank 0 --------------------------------------------------------------------------------------
    def _ask(self, message: dict) -> list:
        """Broadcast ``message``, answer it here too, and gather every rank's answer (rank 0 only)."""
        dist.broadcast_object_list([message], src=0)
        out: list = [None] * self.size
        dist.gather_object(self._answer(message), out, dst=0)
        return out

    def __enter__(self) -> "TorchrunRanks":
        """Every rank imports the modules and creates the process groups of the world size's meshes,
        as a gang's ranks do when they start; raises :class:`GangError` naming a rank that could not."""
        if self.state is None:
            answers = self._ask({"kind": "start", "modules": self.modules})
            bad = next(((r, a["error"]) for r, a in enumerate(answers) if a.get("error")), None)
            if bad:
                raise GangError(f"rank {bad[0]} ({answers[bad[0]]['host']}) failed to start: {bad[1]}")
            self.starts += 1
        return self

    def __exit__(self, *exc) -> None:
        pass  # the ranks serve until :meth:`close`

    def run(self, job: dict, ranks: int, timeout_s: float) -> list[RankAnswer]:
        """Run ``job`` on ranks ``0 .. ranks-1`` (the others idle) and return their answers, as
        :meth:`Gang.run` does. A case still running after ``timeout_s`` ends the job (exit 1)."""
        job = dict(job, id=next(self._ids))
        timer = threading.Timer(timeout_s, _expire, (job, timeout_s))
        timer.daemon = True
        timer.start()
        try:
            answers = self._ask({"kind": "job", "ranks": ranks, "job": job})
        finally:
            timer.cancel()
        return [RankAnswer(r, result=answers[r]) for r in range(ranks)]

    def unseen(self, directory: str) -> list[str]:
        """The ranks (``rank N on HOST``) that cannot read a file written in ``directory`` here: a
        directory the generated programs and checkpoints go to must be one every rank sees."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        probe, nonce = path / f".verify-shared-{secrets.token_hex(8)}", secrets.token_hex(16)
        probe.write_text(nonce)
        try:
            answers = self._ask({"kind": "probe", "path": str(probe), "nonce": nonce})
        finally:
            probe.unlink(missing_ok=True)
        return [f"rank {r} on {host}" for r, (seen, host) in enumerate(answers) if not seen]

    def close(self) -> None:
        """Tell the serving ranks to stop (rank 0; once)."""
        if not self._closed and self.rank == 0:
            self._closed = True
            dist.broadcast_object_list([None], src=0)

    # -- every rank ------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Answer rank 0's messages until it says stop (ranks other than 0)."""
        while True:
            box = [None]
            try:
                dist.broadcast_object_list(box, src=0)
                if box[0] is None:
                    return
                dist.gather_object(self._answer(box[0]), None, dst=0)
            except (RuntimeError, dist.DistError) as exc:  # rank 0 ended the job (a case past its limit)
                text = str(exc).strip()
                raise SystemExit(f"verify.cluster: rank {self.rank}: the job ended under it "
                                 f"({type(exc).__name__}: {text.splitlines()[0][:200] if text else ''})") from None

    def _answer(self, message: dict):
        host = socket.gethostname()
        if message["kind"] == "start":
            try:
                registry, error = worker.load_modules(message["modules"]), None
            except Exception as exc:
                registry, error = None, f"{type(exc).__name__}: {exc}".splitlines()[0]
            groups = GroupCache(datetime.timedelta(seconds=PG_TIMEOUT_S))  # collective: on every rank alike
            groups.create_for_shapes(mesh_shapes(self.size))
            if error:
                return {"host": host, "error": error}
            self.state = worker.RankState(self.rank, registry, groups, self.device)
            return {"host": host}
        if message["kind"] == "probe":
            try:
                return Path(message["path"]).read_text() == message["nonce"], host
            except OSError:
                return False, host
        if self.rank >= message["ranks"]:
            return None
        return worker.isolated(self.state, message["job"], self.cwd)


def _expire(job: dict, timeout_s: float) -> None:
    """A case past its limit: one line, and the job ends (the other ranks are ended by torchrun)."""
    kind = {"op_partitions": "sampling of op"}.get(job.get("kind"), job.get("kind"))
    what = f"{kind} {job.get('model') or job.get('op', '')} {job.get('policy') or job.get('partition') or ''}"
    print(f"verify.cluster: {' '.join(what.split())} at W={job.get('world_size', 1)} gave no answer within its limit of {timeout_s:.0f} s; "
          f"ending the job (a rank may be stuck in a collective)", file=sys.stderr, flush=True)
    os._exit(1)
