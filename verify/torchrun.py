"""``python -m verify.torchrun [--host ADDR] [torchrun options] SCRIPT [args]``: ``torchrun`` that
listens on the loopback interface only.

Plain ``torchrun`` hosts its stores on every interface (``*:port``), reachable from other hosts.
This runs torchrun's own launcher in-process with a rendezvous handler ("loopback") whose stores
(the rendezvous store and the store the workers share) are hosted on sockets bound to ``--host``
(127.0.0.1 unless you ask for another), with ``--local-addr`` set to it and gloo on the loopback
interface. torch offers no option for the bind address, hence this handler. Single machine only.
"""
from __future__ import annotations

import os
import sys
from typing import Sequence

from verify.runner.gang import host_store

BACKEND = "loopback"


def _register(host: str) -> list:
    """Register the ``loopback`` rendezvous backend; returns what must stay alive while it is used."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    keep: list = []

    class Backend(C10dRendezvousBackend):
        @property
        def name(self) -> str:
            return BACKEND

    def create(params):
        store, sock = host_store(host)
        keep.extend([store, sock])
        handler = create_handler(store, Backend(store, params.run_id), params)

        def shared_store(_addr, _port):  # the store the workers share, on ``host`` too
            s, k = host_store(host)
            keep.extend([s, k])
            return s

        handler._create_tcp_store_server = shared_store
        return handler

    rendezvous_handler_registry.register(BACKEND, create)
    return keep


def command(args: Sequence[str], host: str = "127.0.0.1") -> list[str]:
    """A shell command that runs torchrun ``args`` listening on ``host`` only."""
    return [sys.executable, "-m", "verify.torchrun", "--host", host, *args]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    host = "127.0.0.1"
    if argv[:1] == ["--host"]:
        if len(argv) < 2:
            print("verify.torchrun: error: --host needs an address", file=sys.stderr)
            return 2
        host, argv = argv[1], argv[2:]
    if not argv:
        print("usage: python -m verify.torchrun [--host ADDR] [torchrun options] SCRIPT [args]", file=sys.stderr)
        return 2
    clash = [a for a in argv if a.split("=")[0] in ("--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint",
                                                     "--rdzv_endpoint", "--master-addr", "--master_addr",
                                                     "--standalone", "--local-addr", "--local_addr")]
    if clash:
        print(f"verify.torchrun: error: {clash[0]} is set by this launcher (use --host)", file=sys.stderr)
        return 2
    if host in ("127.0.0.1", "::1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    keep = _register(host)
    from torch.distributed.run import main as torchrun_main
    try:
        torchrun_main(["--rdzv-backend", BACKEND, "--rdzv-endpoint", f"{host}:0", "--local-addr", host, *argv])
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except Exception as exc:  # ChildFailedError: torchrun printed the workers' failures already
        print(f"verify.torchrun: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
              file=sys.stderr)
        return 1
    finally:
        keep.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
