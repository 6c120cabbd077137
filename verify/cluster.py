"""``torchrun [...] -m verify.cluster model NAME [options of verify model]`` (or ``op NAME [...]``, or
``plan PATH [--as-planned ...]``): ``verify model``/``op``/``plan`` with the parallel side on the ranks of
a torchrun job, on as many nodes as torchrun starts, at its world size (``WORLD_SIZE``); a saved plan
``--as-planned`` runs at the very degrees it was planned for.

Every rank joins the process group torchrun describes (:func:`verify.runner.torchrun_ranks.join`);
rank 0 runs the command exactly as ``python -m verify`` does (the same checks of its input, cases,
judging, table, reports and exit code: 0 every row matched, 1 a row failed, 2 bad input, one line on
stderr) with the job's ranks in the place of the one-machine gang; the other ranks answer its jobs
and exit 0. The single-device reference of a whole-model case runs on rank 0 alone and is broadcast
to the others (:mod:`verify.cases.reference`; each rank judges its own parallel tensors against it),
so the model must fit rank 0's memory; operator cases compute their small references on every rank.
With several nodes, ``--gen-dir`` must name a directory every rank sees (a shared
filesystem): the ranks write the generated programs and checkpoints there and read each other's.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Sequence

COMMANDS = ("model", "op", "plan")
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
USAGE = ("usage: torchrun [torchrun options] -m verify.cluster {model,op} NAME | plan PATH "
         "[options of python -m verify model/op/plan]")
SHARED_DIR = {"model": "gen_dir", "plan": "keep"}  # the option naming the directory every rank reads and writes


def _prepare(ranks):
    """The ``prepare`` hook of :func:`verify.cli.main`: torchrun's world size and ranks in the place
    of ``--world-size`` and the gang; bad input raises ``UsageError`` (one line, exit 2)."""
    from verify.cli import UsageError
    from verify.runner.gang import DEFAULT_MEMORY_MB

    def prepare(args) -> None:
        if getattr(args, "world_size", None) is not None:
            raise UsageError(f"--world-size: torchrun sets the world size (WORLD_SIZE={ranks.size} here); leave it out")
        if getattr(args, "rank_memory", DEFAULT_MEMORY_MB) != DEFAULT_MEMORY_MB:
            raise UsageError("--rank-memory caps the ranks of the one-machine gang; under torchrun leave it out")
        attr = SHARED_DIR.get(args.command)
        flag = f"--{attr.replace('_', '-')}" if attr else ""
        gen_dir = getattr(args, attr, None) if attr else None
        if ranks.multinode and attr and gen_dir is None:
            raise UsageError(f"{ranks.size} ranks on several nodes: give {flag} DIR on a filesystem every node sees "
                             f"(each rank reads its model and writes its programs and checkpoint shards there, and "
                             f"reads the others')")
        if gen_dir is not None:
            setattr(args, attr, str(Path(gen_dir).resolve()))
            try:
                unseen = ranks.unseen(getattr(args, attr))
            except OSError as exc:
                raise UsageError(f"{flag} {gen_dir}: cannot write: {exc.strerror or exc}") from None
            if unseen:
                raise UsageError(f"{flag} {gen_dir}: {', '.join(unseen[:3])} cannot read what rank 0 writes there; "
                                 f"give a directory every node sees (a shared filesystem)")
        ranks.modules = [str(Path(m).resolve()) for m in args.module]
        args.world_size = [ranks.size]
        args.ranks = ranks
    return prepare


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rank0 = os.environ.get("RANK", "0") == "0"
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]  # before torch is imported: seconds
    if missing or argv[:1] not in ([c] for c in COMMANDS):
        if rank0:
            why = f"run under torchrun ({', '.join(missing)} not set); on one machine use python -m verify" \
                if missing else USAGE
            print(f"verify.cluster: error: {why}", file=sys.stderr)
        return 2 if rank0 else 0
    import torch.distributed as dist

    from verify.runner.torchrun_ranks import TorchrunRanks, join
    ranks = TorchrunRanks(join(), os.getcwd())
    try:
        if ranks.rank != 0:
            ranks.serve()
            return 0
        from verify.cli import main as verify_main
        try:
            return verify_main(argv, prepare=_prepare(ranks))
        finally:
            ranks.close()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # every verdict, report and rank exchange is done and the process group destroyed: exit without the
    # interpreter's teardown, where a C++ thread of torch's may still abort ("terminate called without an
    # active exception", exit -6, seen on rank 0 after its table was printed) and fail a job that matched
    os._exit(code)
