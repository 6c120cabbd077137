"""One rank's part of a torch-parallelization case (``verify model FILE.py:build --parallelize
FILE.py:fn``; the contract is :mod:`verify.api`'s): the model built afresh, ``fn``
applied on the case's ``DeviceMesh``, a few AdamW steps judged as compiled plans are
(:func:`verify.cases.step_checks.step_checks`: the loss and every gradient at the single-device run's
parameters, each update against AdamW on one device fed the parallel gradients), then a
``torch.distributed.checkpoint`` save on the ranks and a resume on one device: every parameter and
optimizer moment equal to what was saved, and one more step of the resumed single-device run
against the parallel run's."""
from __future__ import annotations

import contextlib
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from nnscaler.runtime.mesh import GroupCache

from verify.cases.batch import cast
from verify.cases.fresh import load_like
from verify.judge.dtypes import to_dtype
from verify.cases.torchpar.steps import ReferenceSteps
from verify.cases.resume import exact
from verify.cases.torchpar.build import parallel_model
from verify.cases.samples import DTYPES
from verify.api import Parallelized, Pipelined
from verify.cases.torchpar.gang_mesh import gang_groups
from verify.cases.torchpar.mesh import build_mesh, dp_slice, loss_axes, token_degree
from verify.cases.torchpar.localize import ModuleStack
from verify.cases.torchpar.names import model_state_dict, named_parameters
from verify.cases.torchpar.ring_cpu import cpu_ring_attention
from verify.cases.torchpar.fsdp import loss_scale, sum_reductions_on_gloo
from verify.cases.torchpar.pipeline import pipeline_checks
from verify.judge.compare import Check
from verify.judge.verdict import RaisedAfter
from verify.models.loader import build_model, file_tag

def _whole(x):
    return x.full_tensor() if isinstance(x, DTensor) else x


class Whole:
    """The parallel module seen whole, as :func:`~verify.cases.step_checks.step_checks` reads a compiled
    one: full gradients and parameters (collective: every rank calls these in the same order)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def whole_grads(self) -> dict[str, torch.Tensor]:
        return {n: _whole(p.grad).detach() for n, p in named_parameters(self.module) if p.grad is not None}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: _whole(p).detach() for n, p in named_parameters(self.module)}


def load_whole(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Each parameter takes its piece of the whole tensor in ``state``: a DTensor the block at its
    global offset (``compute_local_shape_and_global_offset``, which DCP uses to save it). Written
    here because ``set_model_state_dict(full_state_dict=True)`` goes through ``distribute_tensor``,
    which raises (an AssertionError in ``_StridedShard._shard_tensor``, torch 2.13) for FSDP2 over
    tensor parallelism when a dimension does not divide (the vocabulary of 101 over 2 x 2)."""
    with torch.no_grad():
        for n, p in named_parameters(module):
            if isinstance(p, DTensor) and any(isinstance(q, _StridedShard) for q in p.placements):
                # a strided shard holds several pieces, not one block at an offset (transformers' packed
                # gate|up): the local piece as DTensor cuts it, on every rank alike (no communication)
                p.to_local().copy_(distribute_tensor(state[n], p.device_mesh, p.placements, src_data_rank=None).to_local())
            elif isinstance(p, DTensor):
                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                p.to_local().copy_(state[n][tuple(slice(o, o + s) for o, s in zip(offset, shape))])
            else:
                p.copy_(state[n])


def _moments(module, opt) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): n for n, p in named_parameters(module)}
    return {names[id(p)]: {k: _whole(v).detach().clone() for k, v in st.items()} for p, st in opt.state.items()}


def _step(par: Parallelized, args: tuple, mesh, crumb=None) -> torch.Tensor:
    """Forward and backward of this rank's slice inside the plan's context; the step's loss (the
    mean over the ``dp`` ranks). An exception names the module it was raised in."""
    scale, _ = loss_scale(par.module, token_degree(mesh))  # a program that sums FSDP's gradients undivided (verify/cases/torchpar/fsdp.py)
    local = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in dp_slice(args, mesh))  # its own: cp shards in place
    batch = par.batch_context(*local) if par.batch_context is not None else contextlib.nullcontext()
    with ModuleStack(par.module, crumb) as stack, stack.naming(), par.step_context(), batch:
        loss = par.module(*local)
        stack.backward()
        (loss * scale if scale != 1.0 else loss).backward()
    loss = _whole(loss).detach().clone()
    for axis in loss_axes(mesh):  # the mean over the ranks sharing the step's tokens
        dist.all_reduce(loss, group=mesh[axis].get_group())
        loss /= mesh[axis].size()
    return loss


def run_torchpar_job(job: dict, groups: GroupCache, crumb=None) -> list[Check]:
    """The checks of a ``torchpar`` job (keys: model, parallelize, mesh [[name, size], ...],
    world_size, steps, seed, gen_dir, dtype); a user's ``context_parallel`` runs its ring attention
    through the CPU kernel (:mod:`verify.cases.torchpar.ring_cpu`), said in a note of the row."""
    with cpu_ring_attention() as ring, gang_groups(groups):  # meshes fn lays itself (torchtitan's) take the gang's groups
        try:
            checks = _checks(job, groups, crumb)
        except RaisedAfter as exc:
            exc.checks += _ring_note(ring)
            raise
    return checks + _ring_note(ring)


def _ring_note(ring) -> list[Check]:
    return [Check("note: cp", 0.0, 0.0, True, ring.note())] if ring.calls else []


def _checks(job: dict, groups: GroupCache, crumb=None) -> list[Check]:
    dtype = job.get("dtype", "float32")
    dt = DTYPES[dtype]
    names, sizes = tuple(n for n, _ in job["mesh"]), tuple(s for _, s in job["mesh"])
    mesh = build_mesh(names, sizes, groups)
    try:
        par, (case, ref) = parallel_model(job["model"], job["parallelize"], job["seed"], dt, mesh)
    except Exception as exc:  # nothing ran yet: no module to localise (verify/rows/torchpar.py: BUILD_RAISED)
        raise RaisedAfter([], exc, "fn(model, mesh) on the ranks") from exc
    if isinstance(par, Pipelined):  # stages and a schedule (verify/cases/torchpar/pipeline.py)
        return pipeline_checks(job, groups, par, mesh, case, ref, dt, load_whole)
    whole = Whole(par.module)
    ref64 = load_like(to_dtype(build_model(job["model"], job["seed"]).model, torch.float64), ref)
    params = dict(ref.named_parameters())
    got = [n for n, _ in named_parameters(par.module)]
    if sorted(got) != sorted(params):
        extra, lost = sorted(set(got) - set(params)), sorted(set(params) - set(got))
        return [Check("parameter names", float("inf"), 0.0, False, f"the parallelized module renames parameters "
                      f"(lacks {lost[:3]}, has {extra[:3]}); return a module with the model's parameter names")]
    initial = whole.state_dict()
    checks = [exact(f"initial {n}", initial.get(n), p.detach()) for n, p in params.items()]
    steps = ReferenceSteps.fresh(ref, ref64, par.module.parameters(), dt)
    for step in range(job["steps"]):
        args = cast(case.batch(step), dt)
        checks += steps.step(step, args, whole, lambda point: load_whole(par.module, point),
                             lambda: _step(par, args, mesh, crumb))
    opts, fallback = steps.opts, steps.fallback
    checks += [Check(f"note: {what}", 0.0, 0.0, True, text) for what, text in
               (("fsdp on gloo", sum_reductions_on_gloo(par.module)), ("fsdp loss scale", loss_scale(par.module, token_degree(mesh))[1]))
               if text]
    if job.get("checkpoint", True):
        try:
            checks += resume_checks(job, par, opts[0], mesh, dt, case, groups)
        except (Exception, CheckpointException) as exc:  # the training checks stand; the row is an error naming
            # the resume (torch.distributed.checkpoint's errors are BaseExceptions)
            raise RaisedAfter(checks + fallback.notes(dtype, checks), exc, "the checkpoint resume") from exc
    return checks + fallback.notes(dtype, checks)


def resume_checks(job: dict, par: Parallelized, opt, mesh, dt: torch.dtype, case, groups: GroupCache) -> list[Check]:
    """Save the parallel module and its AdamW state with ``torch.distributed.checkpoint``
    (``get_model_state_dict``/``get_optimizer_state_dict``, each rank writing its shards), load them
    on one device into a model built afresh (``dcp.load(no_dist=True)``): every parameter and moment
    equals what was saved, bit for bit. Then one more step: the resumed model's loss and gradients
    against the parallel run's, and the resumed optimizer fed the parallel gradients against the
    parallel optimizer's update."""
    rank, steps = dist.get_rank(), job["steps"]
    path = Path(job["gen_dir"]) / f"dcp-{file_tag(job['model'])}-{file_tag(job['parallelize'])}-w{job['world_size']}-s{job['seed']}"
    everyone = groups.get(range(job["world_size"]))  # the case's ranks (the gang may hold more)
    if rank == 0 and path.exists():
        shutil.rmtree(path)
    dist.barrier(group=everyone)
    saved, saved_moments = Whole(par.module).state_dict(), _moments(par.module, opt)
    model_state, via = model_state_dict(par.module)
    dcp.save({"model": model_state, "optim": get_optimizer_state_dict(par.module, opt)},
             checkpoint_id=path, process_group=everyone)
    dist.barrier(group=everyone)
    single = to_dtype(build_model(job["model"], job["seed"]).model, dt)
    single_opt = torch.optim.AdamW(single.parameters(), lr=opt.defaults["lr"])
    state = {"model": get_model_state_dict(single) if via is None else single.state_dict(),
             "optim": get_optimizer_state_dict(single, single_opt)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)
    if via is None:
        set_model_state_dict(single, state["model"])
    else:  # the model's own load hooks take its own state dict back
        single.load_state_dict(state["model"])
    set_optimizer_state_dict(single, single_opt, state["optim"])
    checks = [Check("note: resume", 0.0, 0.0, True, via)] if via else []
    checks += [exact(f"resumed on one device: param {n}", p.detach(), saved[n]) for n, p in single.named_parameters()]
    moments = _moments(single, single_opt)
    checks += [exact(f"resumed on one device: optimizer {k} of {n}", moments.get(n, {}).get(k), t)
               for n, st in saved_moments.items() for k, t in st.items()]
    # one more step from the checkpoint: the resumed run is the reference of the parallel run's
    args = cast(case.batch(steps), dt)
    single64 = load_like(to_dtype(build_model(job["model"], job["seed"]).model, torch.float64), single)
    params = dict(single.named_parameters())  # the resumed model is the shadow, its AdamW fed the parallel gradients
    resumed = ReferenceSteps(single, single64, dt, [opt, single_opt], params).step(
        steps, args, Whole(par.module), None, lambda: _step(par, args, mesh))
    return checks + [Check(f"resumed on one device: {c.name}", c.err, c.tol, c.ok, c.reason) for c in resumed]

