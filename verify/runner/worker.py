"""The loop each rank of the gang runs: join the process group once, then answer jobs until told to stop."""
from __future__ import annotations

import datetime
import os
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from nnscaler.ops.registry import DEFAULT_REGISTRY, OpRegistry
from nnscaler.runtime.mesh import GroupCache, mesh_shapes

from verify.judge.verdict import Divergence, RaisedAfter, Unverifiable
from verify.kinds import kind_of
from verify.kinds.registry import CaseKind
from verify.runner import isolation
from verify.runner.rank_logs import Breadcrumb, redirect_stderr
from verify.user_files import import_once


def load_modules(paths: Sequence[str]) -> OpRegistry:
    """Import ``opzoo`` and each user file (their ``register_op`` calls fill the default registry); a
    file's folder joins ``sys.path`` (last), so its sibling modules import as under ``python FILE.py``
    (as a ``FILE.py:builder`` model's do: :mod:`verify.models.loader`)."""
    import opzoo  # noqa: F401  (registers the built-in operators)
    for path in paths:  # each file once, whatever else imports it (verify/user_files.py)
        p = Path(path).resolve()
        if str(p.parent) not in sys.path:
            sys.path.append(str(p.parent))
        import_once(p, f"verify_user_{abs(hash(str(p)))}")
    return DEFAULT_REGISTRY


@dataclass
class RankState:
    """Everything a rank keeps between jobs (an explicit context, not module globals)."""

    rank: int
    registry: OpRegistry
    groups: GroupCache
    device: torch.device
    kept: dict = field(default_factory=dict)  # what the case kinds keep between jobs, by their own keys
    crumb: Breadcrumb | None = None  # where the rank is, for the harness to name if it dies there


def _short(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = next((f for f in reversed(frames) if "site-packages" not in f.filename), frames[-1] if frames else None)
    loc = f" (at {Path(where.filename).name}:{where.lineno})" if where else ""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint's error: {rank: (exception, trace)}
    if isinstance(failures, dict) and failures:
        rank, (first, *_) = next(iter(sorted(failures.items())))
        text = str(first).strip().splitlines()
        msg = f"on rank {rank}: {type(first).__name__}: {text[0] if text else ''}"
    return f"{type(exc).__name__}: {msg}{loc}"


def _localized(case: CaseKind, result: dict, state: RankState) -> dict:
    """A localising kind's result: its checks and, when one fails, where the programs part ways (the
    first divergent operator, or a line saying where else the fault lies)."""
    job = case.job
    w = job["world_size"]
    mine = next((c["name"] for c in result["checks"] if not c["ok"]), None)
    everyone = [mine]
    if w > 1:  # every rank of the case takes the same decision, or the localiser's collectives would hang
        everyone = [None] * w
        dist.all_gather_object(everyone, mine, group=state.groups.get(list(range(w))))
    first = next((n for n in everyone if n is not None), None)
    if first is None and not job.get("localize"):  # ``localize``: say where anyway (tests of localisers)
        return result
    try:
        found = case.localize(state, first or "")
    except Exception as exc:  # the verdict stands; say why no operator could be named
        return dict(result, divergence_error=_short(exc))
    if isinstance(found, str):
        return dict(result, divergence_note=found)
    if isinstance(found, Divergence):
        return dict(result, divergence=asdict(found))
    return result if found is None else dict(result, **found.result())


def handle(state: RankState, job: dict) -> dict:
    """Answer one job: its kind's case (:mod:`verify.kinds`) run on this rank, localised when one of
    its checks fails, and the seconds it took."""
    start = time.perf_counter()
    try:
        case = kind_of(job)
        result = case.run(state)
        if case.localizes and "checks" in result:
            result = _localized(case, result, state)
        return dict(result, seconds=time.perf_counter() - start)
    except RaisedAfter as exc:  # an error that keeps the checks made before it
        cause = exc.cause
        return {"error": f"{exc.where} raised {_short(cause)}", "error_type": type(cause).__name__,
                "traceback": "".join(traceback.format_exception(cause)), "checks": [c.__dict__ for c in exc.checks],
                "seconds": time.perf_counter() - start}
    except Unverifiable as exc:  # a program that draws random numbers: never a match, never a mismatch
        return {"unverifiable": str(exc), "seconds": time.perf_counter() - start}
    except BaseException as exc:  # a failing case is a result, never a dead rank
        # other BaseExceptions (SystemExit, torch.distributed.checkpoint's CheckpointException) are
        # the case's own errors; an interrupt stops the rank
        if isinstance(exc, (KeyboardInterrupt, GeneratorExit)):
            raise
        return {"error": _short(exc), "error_type": type(exc).__name__, "traceback": traceback.format_exc(),
                "seconds": time.perf_counter() - start}


def isolated(state: RankState, job: dict, cwd: str) -> dict:
    """:func:`handle` from the known state; a job that leaves global state changed, or that leaves
    processes behind, is an error whatever it computed (the next job starts clean either way)."""
    isolation.reset(job.get("seed", 0), cwd)
    result = handle(state, job)
    leaked = isolation.drift(cwd)
    if isolation.kill_tree(os.getpid()):
        leaked.append("child processes left running (killed)")
    if leaked and not result.get("error"):
        result = dict(result, error=f"StateLeak: the case left global state changed: {', '.join(leaked)}",
                      error_type="StateLeak", traceback="")
    isolation.reset(0, cwd)
    return result


def main(rank: int, world_size: int, addr: tuple[str, int], inbox, outbox, modules: Sequence[str],
         world_sizes: Sequence[int], pg_timeout_s: float, harness_pid: int,
         logs: tuple[str, str] | None = None) -> None:
    """Entry point of one gang process: rendezvous at the store the harness hosts on ``addr``; ``logs``:
    the files its standard error and its breadcrumb go to (:mod:`verify.runner.rank_logs`)."""
    isolation.bind_to_parent(harness_pid)
    if logs is not None:
        redirect_stderr(logs[0])
    os.environ["GLOO_SOCKET_IFNAME"] = "lo" if addr[0] in ("127.0.0.1", "::1", "localhost") else \
        os.environ.get("GLOO_SOCKET_IFNAME", "")
    if not os.environ["GLOO_SOCKET_IFNAME"]:
        del os.environ["GLOO_SOCKET_IFNAME"]
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=pg_timeout_s)
    cwd = os.getcwd()
    try:
        cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
        if cuda:
            torch.cuda.set_device(rank)
        store = dist.TCPStore(addr[0], addr[1], world_size, False, timeout=datetime.timedelta(seconds=120))
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        with warnings.catch_warnings():  # the harness imported these files first and said what they warn of
            warnings.simplefilter("ignore")
            registry = load_modules(modules)
        groups = GroupCache(timeout)
        groups.create_for_shapes([s for w in sorted(set(world_sizes)) for s in mesh_shapes(w)])
        state = RankState(rank, registry, groups, torch.device("cuda", rank) if cuda else torch.device("cpu"),
                          crumb=Breadcrumb(logs[1]) if logs is not None else None)
    except Exception as exc:
        outbox.put(("ready", rank, {"error": _short(exc)}))
        return
    outbox.put(("ready", rank, {}))
    while True:
        job = inbox.get()
        if job is None:
            break
        outbox.put((job["id"], rank, isolated(state, job, cwd)))
    dist.destroy_process_group()
