"""``python -m verify.torchrun [--host ADDR] [--port P] [torchrun options] SCRIPT [args]``: ``torchrun``
that listens on one address only (127.0.0.1 unless told).

Plain ``torchrun`` hosts its stores on every interface (``*:port``), reachable from other hosts.
This runs torchrun's own launcher in-process with a rendezvous handler ("loopback"), torchrun's
static rendezvous with one difference: node 0 (``--node-rank 0``, the default) hosts the one store
that the launchers and the workers share on a socket bound to ``--host`` (torch offers no option
for the bind address, hence this handler), and every other node connects to it at ``--host:--port``.
``--local-addr`` is set to ``--host`` and gloo uses the loopback interface when ``--host`` is one.

So launchers on one machine form one job of several "nodes" over the loopback interface, as the
nodes of a cluster do::

    python -m verify.torchrun --nnodes 2 --node-rank 0 --port 29517 --nproc-per-node 2 SCRIPT ...
    python -m verify.torchrun --nnodes 2 --node-rank 1 --port 29517 --nproc-per-node 2 SCRIPT ...

On a real cluster use plain ``torchrun`` (``docs/cluster.md``).
"""
from __future__ import annotations

import datetime
import os
import sys
from typing import Sequence

from verify.runner.gang import host_store

BACKEND = "loopback"
OWN = ("--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-conf", "--rdzv_conf",
       "--master-addr", "--master_addr", "--master-port", "--master_port", "--standalone", "--local-addr",
       "--local_addr")  # set by this launcher: --host and --port say where node 0 listens


CHECKED_OUT, ALL_CHECKED_OUT = "verify/checked_out", "verify/all_checked_out"  # node 0 closes the store last


class LaunchError(ValueError):
    """Bad launcher options: one line, exit 2."""


def _handler_class():
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo

    class LoopbackRendezvous(RendezvousHandler):
        """torchrun's ``static`` rendezvous (``static_tcp_rendezvous.py``) with node 0's store bound to
        ``host`` only; the workers share it (``use_agent_store``)."""

        def __init__(self, host: str, port: int, node_rank: int, nnodes: int, run_id: str, timeout_s: float):
            self.host, self.port, self.node_rank, self.nnodes = host, port, node_rank, nnodes
            self.run_id, self.timeout = run_id, datetime.timedelta(seconds=timeout_s)
            self._store = self._sock = None

        def get_backend(self) -> str:
            return BACKEND

        @property
        def use_agent_store(self) -> bool:
            return True

        def next_rendezvous(self) -> RendezvousInfo:
            if self._store is None:
                if self.node_rank == 0:
                    self._store, self._sock = host_store(self.host, self.timeout.total_seconds(), self.port)
                    self.port = self._sock.getsockname()[1]
                else:
                    self._store = TCPStore(self.host, self.port, None, False, self.timeout)
            return RendezvousInfo(PrefixStore(self.run_id, self._store), self.node_rank, self.nnodes,
                                  RendezvousStoreInfo(self.host, self.port))

        def is_closed(self) -> bool:
            return False

        def set_closed(self) -> None:
            pass

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return self.run_id

        def shutdown(self) -> bool:
            """Called by every node's launcher once its agent is done (after its exit barrier)."""
            if self._store is not None and self.nnodes > 1:
                self._leave()
            if self._sock is not None:
                self._sock.close()
            return True

        def _leave(self, timeout_s: float = 30.0) -> None:
            """Node 0 hosts the store, so it closes last: it checks in at the agents' exit barrier if its
            agent did not (it skips the barrier when its workers failed), then waits until every other
            node has checked out (each does once its own barrier returned). Closing at the barrier
            alone races: the other nodes' barrier may not have read its answer yet (torch's agent then
            logs a traceback on that node)."""
            from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
            from torch.distributed.elastic.utils import store as store_util
            store = PrefixStore(self.run_id, self._store)
            try:
                if self.node_rank != 0:
                    if store.add(CHECKED_OUT, 1) == self.nnodes - 1:
                        store.set(ALL_CHECKED_OUT, "1")
                    return
                if store.add(_TERMINAL_STATE_SYNC_ID + store_util._NUM_MEMBERS, 0) < self.nnodes:
                    store_util.barrier(store, self.nnodes, _TERMINAL_STATE_SYNC_ID, barrier_timeout=timeout_s)
                with store_util.store_timeout(store, timeout_s):
                    store.wait([ALL_CHECKED_OUT])
            except Exception:  # a node that never arrives: it sees the store go, as under torchrun's own
                pass

    return LoopbackRendezvous


def _create(params):
    """The ``loopback`` handler from torchrun's rendezvous parameters (endpoint ``host:port``, the
    node's rank in ``rdzv-conf``)."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    host, port = parse_rendezvous_endpoint(params.endpoint, 0)
    return _handler_class()(host, port, int(params.config["node_rank"]), params.max_nodes, params.run_id,
                            float(params.config.get("timeout", 600)))


def command(args: Sequence[str], host: str = "127.0.0.1", port: int | None = None) -> list[str]:
    """A shell command that runs torchrun ``args`` listening on ``host`` only (node 0 on ``port``)."""
    return [sys.executable, "-m", "verify.torchrun", "--host", host, *(["--port", str(port)] if port else []), *args]


def _parse(argv: list[str]) -> tuple[str, int, int, list[str]]:
    """``(host, port, node rank, torchrun's argv)``: this launcher's ``--host`` and ``--port``, and
    ``--node-rank`` (torchrun uses it only for its static rendezvous, and warns otherwise; this handler
    takes it from ``rdzv-conf``), anywhere among torchrun's options, taken out; the rendezvous options
    this launcher sets itself are refused."""
    from torch.distributed.run import get_args_parser
    parser = get_args_parser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", default="0")
    parsed = parser.parse_args(argv)
    try:
        port = int(parsed.port)
    except ValueError:
        raise LaunchError(f"--port must be an integer, got {parsed.port!r}") from None
    if not 0 <= port < 65536:
        raise LaunchError(f"--port must be between 1 and 65535, got {port}")
    lo, _, hi = str(parsed.nnodes).partition(":")
    try:
        nnodes, most = int(lo), int(hi or lo)
    except ValueError:
        raise LaunchError(f"--nnodes must be N or MIN:MAX, got {parsed.nnodes!r}") from None
    if nnodes != most:
        raise LaunchError(f"--nnodes {parsed.nnodes}: this launcher runs a fixed number of nodes (give one number)")
    if not 0 <= parsed.node_rank < nnodes:
        raise LaunchError(f"--node-rank {parsed.node_rank} is outside 0..{nnodes - 1} (--nnodes {nnodes})")
    if nnodes > 1 and not port:
        raise LaunchError(f"--nnodes {nnodes} needs --port P: node 0 listens there and the others connect to it")
    end = argv.index(parsed.training_script) if parsed.training_script in argv else len(argv)
    head, kept, skip = argv[:end], [], False
    clash = [a.split("=")[0] for a in head if a.split("=")[0] in OWN]
    if clash:
        raise LaunchError(f"{clash[0]} is set by this launcher (use --host and --port)")
    for a in head:
        if skip:
            skip = False
        elif a in ("--node-rank", "--node_rank", "--host", "--port"):
            skip = True
        elif not a.startswith(("--node-rank=", "--node_rank=", "--host=", "--port=")):
            kept.append(a)
    return parsed.host, port, parsed.node_rank, kept + argv[end:]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv:
            raise LaunchError("usage: python -m verify.torchrun [--host ADDR] [--port P] [torchrun options] "
                              "SCRIPT [args]")
        host, port, node_rank, argv = _parse(argv)
    except LaunchError as exc:
        print(f"verify.torchrun: error: {exc}", file=sys.stderr)
        return 2
    if host in ("127.0.0.1", "::1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets for several workers, without its banner
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.run import main as torchrun_main
    rendezvous_handler_registry.register(BACKEND, _create)
    try:
        torchrun_main(["--rdzv-backend", BACKEND, "--rdzv-endpoint", f"{host}:{port}", "--rdzv-conf",
                       f"node_rank={node_rank}", "--local-addr", host, *argv])
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except Exception as exc:  # ChildFailedError: torchrun printed the workers' failures already
        return _failed(exc)
    return 0


def _failed(exc: Exception) -> int:
    """The exit code of a failed job: global rank 0's own code (a worker such as ``verify.cluster``
    answers 1 for a mismatch and 2 for bad input there) when it alone failed, or the other ranks were
    only ended by a signal after it (torchrun terminates the rest of a job once one rank exits
    non-zero: who is still running then is a race), else 1."""
    failures = getattr(exc, "failures", None) or {}
    codes = {rank: f.exitcode for rank, f in failures.items()}
    if codes.get(0) in (1, 2) and all(c < 0 for r, c in codes.items() if r != 0):
        return codes[0]
    if codes:
        print("verify.torchrun: the job failed: " + ", ".join(f"rank {r} exit code {c}" for r, c in sorted(codes.items())),
              file=sys.stderr)
    else:
        text = str(exc).strip()
        print(f"verify.torchrun: {type(exc).__name__}: {text.splitlines()[0] if text else ''}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
