"""The loop each rank of the gang runs: join the process group once, then answer jobs until told to stop."""
from __future__ import annotations

import datetime
import importlib.util
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
from nnscaler.recipe import Recipe
from nnscaler.runtime.mesh import GroupCache, RankMesh, mesh_shapes

from verify.judge.verdict import Divergence, Unverifiable
from verify.runner import isolation

from verify.cases import op as rank_case
from verify.cases.conversion import run_conversion
from verify.cases.localize_row import localize_row
from verify.cases.microbatch import run_accumulation_job
from verify.cases.node import node_sample
from verify.cases.memory import MemoryLog
from verify.cases.model import run_model_job
from verify.cases.replicas import run_replicas_case
from verify.cases.samples import DTYPES, Sample, make_sample
from verify.cases.torchpar import run_torchpar_job
from verify.cases.torchpar_modules import localize_torchpar
from verify.cases.traces import TraceCache, graph_ops


def load_modules(paths: Sequence[str]) -> OpRegistry:
    """Import ``opzoo`` and each user file (their ``register_op`` calls fill the default registry)."""
    import opzoo  # noqa: F401  (registers the built-in operators)
    for path in paths:
        p = Path(path).resolve()
        name = f"verify_user_{abs(hash(str(p)))}"
        if name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(name, p)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {path}: not a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return DEFAULT_REGISTRY


@dataclass
class RankState:
    """Everything a rank keeps between jobs (an explicit context, not module globals)."""

    rank: int
    registry: OpRegistry
    groups: GroupCache
    device: torch.device
    cache: dict = field(default_factory=dict)
    traces: TraceCache = field(default_factory=TraceCache)  # whole models traced once, compiled under many plans

    def sample(self, job: dict) -> tuple[Sample, rank_case.Reference]:
        """The sample and reference of a job, reused across its partitions."""
        key = (job["op"], job.get("model"), job["dtype"], job["seed"], job["base"])
        if key not in self.cache:
            self.cache.clear()
            if job.get("model"):  # an operator of a traced model, at its traced lengths
                sample = node_sample(job["model"], job["op"], job["dtype"], job["seed"])
            else:
                sample = make_sample(self.registry.get(job["op"]), DTYPES[job["dtype"]], job["seed"], job["base"])
            self.cache[key] = (sample, rank_case.reference(sample, self.device))
        return self.cache[key]


def _short(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = next((f for f in reversed(frames) if "site-packages" not in f.filename), frames[-1] if frames else None)
    loc = f" (at {Path(where.filename).name}:{where.lineno})" if where else ""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {msg}{loc}"


def _localized(job: dict, checks: list, state: RankState) -> dict:
    """A model job's result: its checks and, when one fails, where the programs part ways (the
    first divergent operator, or a line saying where else the fault lies)."""
    result = {"checks": [c.__dict__ for c in checks]}
    w = job["world_size"]
    mine = next((c.name for c in checks if not c.ok), None)
    everyone = [mine]
    if w > 1:  # every rank of the case takes the same decision, or the localiser's collectives would hang
        everyone = [None] * w
        dist.all_gather_object(everyone, mine, group=state.groups.get(list(range(w))))
    first = next((n for n in everyone if n is not None), None)
    if first is None and not job.get("localize"):  # ``localize``: say where anyway (tests of localisers)
        return result
    try:
        if job["kind"] == "torchpar":  # a torch parallelization: by module hooks (verify/cases/torchpar_modules.py)
            found = localize_torchpar(job, state.groups)
        else:
            found = localize_row(job, first or "", state.groups)
    except Exception as exc:  # the verdict stands; say why no operator could be named
        return dict(result, divergence_error=_short(exc))
    if isinstance(found, str):
        return dict(result, divergence_note=found)
    if isinstance(found, Divergence):
        return dict(result, divergence=asdict(found))
    return result if found is None else dict(result, **found.result())


def handle(state: RankState, job: dict) -> dict:
    """Answer one job: ``plan`` (partitions of an op), ``case`` (one partition on these ranks) or
    ``model`` (train a whole model under a policy) or ``conversion`` (one layout conversion, see
    :mod:`verify.cases.conversion`)."""
    start = time.perf_counter()
    try:
        if job["kind"] == "conversion":
            return dict(run_conversion(job, state.rank, state.groups), seconds=time.perf_counter() - start)
        if job["kind"] == "accumulation":  # several backward passes per step (verify/microbatch_case.py)
            checks = run_accumulation_job(job, state.groups)
            return {"checks": [c.__dict__ for c in checks], "seconds": time.perf_counter() - start}
        log = MemoryLog()  # what a whole-model case measured on this rank (verify/cases/memory.py)
        if job["kind"] == "model" and job.get("plan_ngpus", job["world_size"]) < job["world_size"]:  # replicas
            checks = run_replicas_case(job["model"], job["policy"], job["world_size"], job["plan_ngpus"],
                                       job["steps"], job["seed"], state.groups, job["gen_dir"],
                                       dtype=job.get("dtype", "float32"), recipe=Recipe.from_dict(job.get("recipe")),
                                       traces=state.traces, memory=log)
            return dict(_localized(job, checks, state), seconds=time.perf_counter() - start, memory=log.last,
                        used=graph_ops(state.traces, job["model"]))
        if job["kind"] == "torchpar":  # the user's own torch parallelization (verify/cases/torchpar.py)
            checks = run_torchpar_job(job, state.groups)
            return dict(_localized(job, checks, state), seconds=time.perf_counter() - start)
        if job["kind"] == "model":
            checks = run_model_job(job, state.groups, state.traces, log)
            return dict(_localized(job, checks, state), seconds=time.perf_counter() - start, memory=log.last,
                        used=graph_ops(state.traces, job["model"]))
        sample, ref = state.sample(job)
        if job["kind"] == "plan":
            plans = {w: [p.label for p in rank_case.partitions_of(sample, w, job.get("partition"))]
                     for w in job["world_sizes"]}
            return {"plans": plans, "annotation": sample.spec.annotation,
                    "sizes": dict(sample.bound.sizes), "seconds": time.perf_counter() - start}
        partition = rank_case.partitions_of(sample, job["world_size"], job["partition"])[0]
        if ref.random:
            return {"unverifiable": ref.random, "seconds": time.perf_counter() - start}
        mesh = RankMesh.build(partition.mesh_shape, state.rank, state.groups)
        checks = rank_case.run_case(sample, ref, partition, mesh, state.device)
        return {"checks": [c.__dict__ for c in checks], "seconds": time.perf_counter() - start}
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
         world_sizes: Sequence[int], pg_timeout_s: float, harness_pid: int) -> None:
    """Entry point of one gang process: rendezvous at the store the harness hosts on ``addr``."""
    isolation.bind_to_parent(harness_pid)
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
        state = RankState(rank, registry, groups, torch.device("cuda", rank) if cuda else torch.device("cpu"))
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
