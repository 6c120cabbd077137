"""``nnscaler.parallelize``: trace, plan, generate one program per plan rank, and run this rank's."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys
import types
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from .codegen.emit import generate
from .dimops.partition import Partition
from .ops.registry import OpRegistry
from .policies import ComputeConfig, Plan, PlanError, validate
from .pipeline import is_pipeline_policy, parallelize_pipeline
from .plan_api import attach_stats, canonical_params, resolve_policy, write_report
from .policies.plan import Policy
from .runtime.mesh import GroupCache, RankMesh, mesh_shapes
from .runtime.microbatch import MicroBatchError, split_batch
from .runtime.module import ParallelModule
from .trace.build import Tracer, trace

CODEGEN_VERSION = "2"


class GenSaveDirError(OSError):
    """``gen_savedir`` cannot hold the generated programs (not a directory, not writable)."""


def _ensure_process_group() -> None:
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("parallelize needs a process group: launch with torchrun, or call "
                           "torch.distributed.init_process_group first")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)


def _import(source: str, path: Path, plan_rank: int):
    """The module of ``source``, compiled from that text (never re-read from ``path``, which another
    job may be replacing): a cached file can only be run if it is exactly what the compiler wrote."""
    name = f"nnscaler_gen_{hashlib.sha256(source.encode()).hexdigest()[:16]}_{plan_rank}"
    if name in sys.modules:
        return sys.modules[name]
    module = types.ModuleType(name)
    module.__file__ = str(path)
    exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 (our own generated text)
    sys.modules[name] = module
    return module


@contextlib.contextmanager
def _locked(directory: Path):
    """Hold ``directory/.lock`` exclusively: one job at a time checks and writes programs there."""
    with open(directory / ".lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def _same(path: Path, text: str) -> bool:
    try:
        return path.read_bytes() == text.encode()
    except OSError:
        return False


def _save(directory: Path, plan_rank: int, source: str, reuse: bool) -> Path:
    """Write ``source`` as ``directory/plan_rank_N.py`` unless that file already holds exactly it
    (a tampered, truncated, empty or binary file is rewritten). Raises :class:`GenSaveDirError`."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GenSaveDirError(f"gen_savedir {str(directory)!r} cannot be created: {exc.strerror or exc}") from None
    if not directory.is_dir():
        raise GenSaveDirError(f"gen_savedir {str(directory)!r} is not a directory")
    path = directory / f"plan_rank_{plan_rank}.py"
    try:
        with _locked(directory):
            if not (reuse and _same(path, source)):
                _write(path, source)
    except OSError as exc:
        raise GenSaveDirError(f"gen_savedir {str(directory)!r} is not writable: {exc.strerror or exc}") from None
    return path


def _replica_group(cache: GroupCache, ranks: list[int], create: bool):
    """The group of one plan rank's replicas: from ``cache`` when made beforehand, else a new one
    (``new_group`` is collective: every rank creates every replica group, in order)."""
    try:
        return cache.get(ranks)
    except KeyError:
        if not create:
            raise
        return dist.new_group(ranks)


def parallelize(model: torch.nn.Module, sample_args: Sequence[Any], policy: str | Policy, config: ComputeConfig,
                *, gen_savedir: str | os.PathLike = ".nnscaler", reuse: bool = True, strict: bool = False,
                sample_kwargs: Mapping[str, Any] | None = None, registry: OpRegistry | None = None,
                groups: GroupCache | None = None, verify: str | bool = "warn",
                verify_cache: str | os.PathLike | None = None, tracer: Tracer | None = None) -> ParallelModule:
    """Compile ``model`` for ``config.plan_ngpus`` ranks under ``policy`` and return this rank's module.

    Every rank of the default process group (created from the ``torchrun`` environment if none
    exists) calls this with the same model and sample arguments. The generated program of each
    plan rank is written to ``gen_savedir`` and reused while a hash of the traced graph, the plan and
    the config matches. Ranks beyond ``plan_ngpus`` are data-parallel replicas, each fed its own
    share of the batch; gradients are averaged over them during backward. With ``config.num_microbatches``
    above 1, ``sample_args`` is a whole batch (each tensor's dim 0 a multiple of it) and the program is
    compiled for one micro-batch of it; train with ``module.train_step(*batch)``. ``groups`` reuses process groups made
    beforehand (then only ranks ``0 .. runtime_ngpus-1`` take part; others need not call).

    A cached program is run only if its text is exactly what the compiler writes now (anything else
    is rewritten); writes go under a lock on ``gen_savedir/.lock``, so jobs may share the directory.
    Raises :class:`PlanError` (a policy gives no valid plan), :class:`GenSaveDirError` (``gen_savedir``
    is unusable) or ``nnscaler.codegen.render.CodegenError`` (a value the program cannot write down).

    ``verify``: before generating code, every (operator, partition) pair the plan uses is verified on
    these ranks (cached on disk in ``verify_cache``, default ``~/.cache/nnscaler-verify``):
    ``"strict"`` raises :class:`PlanError` naming a failing operator and partition, ``"warn"`` (the
    default) warns, ``False`` skips it.

    ``config.pp_size > 1`` (or a pipeline policy's name, :data:`nnscaler.pipeline.PIPELINE_POLICIES`)
    cuts the model into pipeline stages, each partitioned by ``policy`` over its own ranks, and returns a
    :class:`nnscaler.pipeline.PipelineModule` (train with its ``train_step``; see :mod:`nnscaler.pipeline`);
    ``verify`` then checks every stage's plan.

    ``tracer``: what traces the model, called as :func:`nnscaler.trace.build.trace` is (default: that);
    a caller compiling one model under several plans may hand back a graph it traced before, on a
    copy (:meth:`~nnscaler.ir.graph.IRGraph.copy`), as ``verify``'s per-rank trace cache does.
    """
    if verify not in ("strict", "warn", False):
        raise PlanError(f"verify must be 'strict', 'warn' or False, got {verify!r}")
    if config.pp_size > 1 or is_pipeline_policy(policy):  # pipeline stages: nnscaler.pipeline
        # parallelize_pipeline checks its input before it makes the process group
        return parallelize_pipeline(model, sample_args, policy, config, gen_savedir=gen_savedir, reuse=reuse,
                                    strict=strict, sample_kwargs=sample_kwargs, registry=registry, groups=groups,
                                    verify=verify, verify_cache=verify_cache, tracer=tracer)
    if config.num_microbatches > 1:  # the sample is a whole batch; the program runs one micro-batch
        try:
            sample_args, sample_kwargs = split_batch(sample_args, sample_kwargs, config.num_microbatches)[0]
        except MicroBatchError as exc:
            raise PlanError(f"sample_args: {exc}") from None
    _ensure_process_group()
    world, rank = dist.get_world_size(), dist.get_rank()
    runtime = config.runtime_ngpus or config.plan_ngpus
    if world != runtime and not (groups is not None and runtime <= world):
        raise PlanError(f"the process group has {world} ranks but the config asks for {runtime} "
                        f"(runtime_ngpus, or plan_ngpus when runtime_ngpus is unset)")
    name, fn = resolve_policy(policy)
    graph = (tracer or trace)(model, sample_args, sample_kwargs, registry=registry, strict=strict)
    canonical_params(model, graph)  # tied parameters go by their first name, once each
    plan: Plan = fn(graph, config)
    if not isinstance(plan, Plan):
        raise PlanError(f"policy {name} returned {type(plan).__name__}, not a Plan")
    odd = next(((k, v) for k, v in plan.partitions.items() if not isinstance(v, Partition)), None)
    if odd is not None:
        raise PlanError(f"policy {name} gave operator {odd[0]} a {type(odd[1]).__name__} ({odd[1]!r}), not a "
                        f"Partition (use Partition.parse(label, world_size))")
    validate(plan, graph, config)
    cache = groups if groups is not None else GroupCache()
    if verify:
        _verify_plan(graph, plan, config, verify, cache, groups is not None, verify_cache)
    attach_stats(plan, graph, config)
    plan_rank, replica = rank % config.plan_ngpus, rank // config.plan_ngpus
    digest = hashlib.sha256("\n".join([CODEGEN_VERSION, str(graph), plan.describe(), repr(plan.mesh_shape),
                                       repr(config), name]).encode()).hexdigest()
    source, _, _ = generate(graph, plan, plan_rank, header=f"[{digest}] {type(model).__name__}: ")
    path = _save(Path(gen_savedir), plan_rank, source, reuse)  # a gen_savedir that cannot be used fails here
    if rank == 0:  # the one-line summary, and the report next to the generated code
        print(plan.one_line(), flush=True)
        write_report(plan, gen_savedir)
    program = _import(source, path, plan_rank)
    for r in range(config.replicas if groups is None else 0):  # every rank creates every group, in order
        cache.create_for_shapes([plan.mesh_shape], offset=r * config.plan_ngpus)
    replica_group = None
    if config.replicas > 1:
        for p in range(config.plan_ngpus):
            ranks = [p + r * config.plan_ngpus for r in range(config.replicas)]
            g = _replica_group(cache, ranks, groups is None)
            if p == plan_rank:
                replica_group = g
    mesh = RankMesh.build(plan.mesh_shape, rank, cache, offset=replica * config.plan_ngpus)
    state = {**graph.constants, **dict(model.named_buffers()), **dict(model.named_parameters())}
    trainable = {n for n, _ in model.named_parameters()}
    module = ParallelModule(program, state, mesh, trainable, replica_group, config.replicas,
                            bucket_bytes=config.bucket_bytes, num_microbatches=config.num_microbatches)
    module.plan, module.graph = plan, graph
    module.process_group = None if runtime == world else cache.get(list(range(runtime)))  # all ranks of the module
    return module


class UnverifiedPlanWarning(UserWarning):
    """An operator of the plan failed verification under the partition the plan gives it."""


def _verify_plan(graph, plan: Plan, config: ComputeConfig, mode: str, groups: GroupCache, user_groups: bool,
                 cache) -> None:
    """Verify the plan's (operator, partition) pairs on the plan ranks of the process group (ranks
    ``0 .. plan_ngpus-1``; replicas receive their verdicts); refuse or warn on failures."""
    from verify.plan_check import cached_verdicts, verify_plan  # the harness, imported only when asked for

    world, rank, n = dist.get_world_size(), dist.get_rank(), plan.world_size
    if n == 1:
        return  # one plan rank: nothing is partitioned
    runtime = config.runtime_ngpus or config.plan_ngpus
    every = None if runtime == world else groups.get(list(range(runtime)))  # all ranks of this module
    verdicts = cached_verdicts(graph, plan, cache)
    complete: list = [None] * runtime
    dist.all_gather_object(complete, verdicts is not None, group=every)
    if not all(complete):  # something to verify: on the plan ranks, the replicas take their verdicts
        if not user_groups:  # new_group is collective: every rank creates every group, in order
            groups.create_for_shapes(mesh_shapes(n))
        verdicts = None
        if rank < n:
            plan_group = None if n == world else groups.get(list(range(n)))
            verdicts = verify_plan(graph, plan, groups=groups, rank=rank, cache_path=cache, group=plan_group)
        if runtime > n:
            box = [verdicts]
            dist.broadcast_object_list(box, src=0, group=every)
            verdicts = box[0]
    judge_verdicts(verdicts, mode, stacklevel=4)


def judge_verdicts(verdicts, mode: str, stacklevel: int = 2) -> None:
    """Raise :class:`PlanError` (``"strict"``) or warn :class:`UnverifiedPlanWarning` (``"warn"``)
    when a verdict failed, naming the operators and partitions."""
    import warnings
    bad = [v for v in verdicts if not v.ok]
    if not bad:
        return
    text = "; ".join(f"{v.op} ({v.spec}) under {v.partition}: {v.reason}" for v in bad[:3])
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    if mode == "strict":
        raise PlanError(f"{len(bad)} operator partitions of the plan failed verification: {text}{more}; fix the "
                        f"annotations (python -m verify op NAME) or pass verify='warn'")
    warnings.warn(f"{len(bad)} operator partitions of the plan failed verification: {text}{more}",
                  UnverifiedPlanWarning, stacklevel=stacklevel)
