"""Users' pipelines (``torch.distributed.pipelining``: GPipe, 1F1B, interleaved, zero bubble; torchtitan's
``pipeline_llm``) trained against one device, one rank's part (the contract: :mod:`verify.api`).

Each rank holds its stages (:class:`~verify.api.Pipelined`) on a mesh with a ``pp`` dimension (and any
other, e.g. ``dp`` whose ranks each get their slice of the batch). A step: the first stage is given the
inputs, the last the target, and the schedule runs its micro-batches; the step's loss is the sum of the
micro-batch losses (their mean where the schedule scales gradients), sent from the last stage to its
``pp`` group, then averaged over ``dp`` (summed where FSDP's gradient division is disabled, as torchtitan
ships it: its ``loss_fn`` divides by the global token count). Parameters, gradients and optimizer moments are read whole from
the stage that holds them (each made whole inside its stage first: ``full_tensor()`` of a DTensor), under
the model's names (the stage module's, after the prefix the stages were cut below). Then the checks of
every torch program (:func:`verify.cases.step_checks.step_checks`) and a resume: the stage modules and
their AdamW saved with ``torch.distributed.checkpoint`` under the model's names, loaded on one device.

One check of its own, ``stage layout``: every module of the model that holds parameters is held by exactly
one stage, and the stages hold them in the order one device runs them (a stage that drops a layer, or
stages assigned out of order, are named here, before the loss they make wrong)."""
from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from verify.api import ParallelizeError, Pipelined
from verify.cases.batch import cast
from verify.cases.fresh import load_like
from verify.judge.dtypes import to_dtype
from verify.cases.torchpar.steps import ReferenceSteps
from verify.cases.resume import exact
from verify.cases.torchpar.fsdp import loss_scale
from verify.cases.torchpar.mesh import dp_slice, loss_axes, token_degree
from verify.cases.torchpar.names import model_name, model_state_dict, named_parameters
from verify.judge.compare import Check
from verify.judge.verdict import RaisedAfter
from verify.models.loader import build_model, file_tag

PP = "pp"
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # one optimizer's state per name, mergeable across stages


def find_prefix(stage_names, model_names) -> str | None:
    """The shortest module path ``P`` (``""``, ``"model."``) of the model under which every stage name ``n``
    is a model name ``P + n``; ``None`` where there is none."""
    model_names = set(model_names)
    prefixes = {""} | {n[:i + 1] for n in model_names for i, c in enumerate(n) if c == "."}
    fits = [p for p in sorted(prefixes, key=len) if all(p + n in model_names for n in stage_names)]
    return fits[0] if fits else None


def check_pipeline(pipe: Pipelined, mesh_names, model_names, fn_name: str) -> None:
    """Before any rank starts (``fn`` run on the fake process group): a ``pp`` mesh dimension, and stage
    modules whose parameters are the model's (under one prefix). :class:`ParallelizeError` otherwise."""
    if PP not in (mesh_names or ()):
        raise ParallelizeError(f"--parallelize {fn_name}: returned a pipeline but the mesh has no dimension named "
                               f"{PP!r}; give --mesh {PP} (or e.g. dp=2,{PP}=2)")
    names = [n for n, _ in named_parameters(pipe.module)]
    names = [n.split(".", 1)[1] for n in names]  # the ModuleList's index dropped: each stage module's own names
    if find_prefix(names, model_names) is None:
        lost = sorted(n for n in names if not any(m.endswith(n) for m in model_names))[:3] or names[:3]
        raise ParallelizeError(f"--parallelize {fn_name}: its stage modules hold parameters the model does not "
                               f"have under one prefix ({', '.join(lost)}); cut the stages from the model, keeping "
                               f"its names")


def micro_batch_mean(schedule) -> bool:
    """Whether the schedule's gradients are those of the mean of its micro-batch losses (it divides them by
    their count, torch's default ``scale_grads=True``), else of their sum: what the step's loss is."""
    return bool(schedule.scale_grads)


def _whole(x):
    return x.full_tensor() if isinstance(x, DTensor) else x


class RankStages:
    """This rank's stages of a :class:`~verify.api.Pipelined`, read whole and under the model's names, and
    trained one step at a time (collective: every rank of the case calls the same methods in order)."""

    def __init__(self, pipe: Pipelined, mesh, model_names):
        self.pipe, self.mesh = pipe, mesh
        self.group = mesh[PP].get_group()
        self.pp = mesh[PP].size()
        own = [n for st in pipe.stages for n, _ in named_parameters(st.submod)]
        self.prefix = pipe.prefix if pipe.prefix is not None else find_prefix(own, model_names)
        if self.prefix is None:
            raise ValueError(f"the stage modules' parameters {own[:3]} are not the model's under one prefix")

    def named_parameters(self):
        for st in self.pipe.stages:
            for n, p in named_parameters(st.submod):
                yield self.prefix + n, p

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def _across(self, local: dict) -> dict:
        """Every stage's ``local`` (name -> tensor) on every rank: the first ``pp`` rank holding a name gives it."""
        everyone = [None] * self.pp
        dist.all_gather_object(everyone, local, group=self.group)
        out = {}
        for part in everyone:
            for n, t in part.items():
                out.setdefault(n, t)
        return out

    def whole_grads(self) -> dict[str, torch.Tensor]:
        return self._across({n: _whole(p.grad).detach() for n, p in self.named_parameters() if p.grad is not None})

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._across({n: _whole(p).detach() for n, p in self.named_parameters()})

    def moments(self, opt) -> dict[str, dict[str, torch.Tensor]]:
        names = {id(p): n for n, p in self.named_parameters()}
        return self._across({names[id(p)]: {k: _whole(v).detach().clone() for k, v in st.items()}
                             for p, st in opt.state.items()})

    def load(self, state: dict, load_whole: Callable) -> None:
        """Each stage module takes its parameters' pieces of ``state`` (whole tensors by model name)."""
        k = len(self.prefix)
        for st in self.pipe.stages:
            load_whole(st.submod, {n[k:]: t for n, t in state.items() if n.startswith(self.prefix)})

    def step(self, args: tuple, dt: torch.dtype) -> torch.Tensor:
        """One schedule step on this rank's ``dp`` slice: inputs to the first stage, the target (the last
        argument) to the last; the step's loss on every rank."""
        *inputs, target = dp_slice(args, self.mesh)
        first = any(s.is_first for s in self.pipe.stages)
        last = any(s.is_last for s in self.pipe.stages)
        losses: list = []
        self.pipe.schedule.step(*(inputs if first else ()), target=target if last else None,
                                losses=losses if last else None)
        loss = torch.zeros((), dtype=dt)
        if last:
            loss = torch.stack([_whole(x).detach().to(dt) for x in losses]).sum()
            if micro_batch_mean(self.pipe.schedule):
                loss = loss / len(losses)
        dist.all_reduce(loss, group=self.group)  # from the last stage's rank (the others add zero)
        for axis in loss_axes(self.mesh):
            dist.all_reduce(loss, group=self.mesh[axis].get_group())
            loss /= self.mesh[axis].size()
        scale, _ = loss_scale(self.pipe.module, token_degree(self.mesh))  # FSDP's division disabled: the loss_fn divides by the global
        return loss / scale if scale != 1.0 else loss  # token count itself, so the step's loss sums over dp

    def stages_held(self) -> dict[int, list[str]]:
        """Stage index -> the model names of the modules holding parameters directly, across ``pp``."""
        mine = {st.stage_index: [self.prefix + model_name(n) for n, m in st.submod.named_modules()
                                 if any(True for _ in m.parameters(recurse=False))] for st in self.pipe.stages}
        everyone = [None] * self.pp
        dist.all_gather_object(everyone, mine, group=self.group)
        return dict(sorted((i, names) for part in everyone for i, names in part.items()))


def call_order(model: torch.nn.Module, args: tuple) -> list[str]:
    """Names of the modules holding parameters directly, in the order one device first calls them."""
    order: list[str] = []
    handles = [m.register_forward_pre_hook(lambda mod, a, n=n: order.append(n) if n not in order else None)
               for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for h in handles:
            h.remove()
    return order


def _short(names: list[str], prefix: str) -> str:
    """Module names as blocks (``layers.0``, ``norm``) without the prefix, in order, once each."""
    out: list[str] = []
    for n in names:
        parts = n[len(prefix):].split(".")
        cut = next((i + 1 for i, p in enumerate(parts) if p.isdigit()), 1)
        block = ".".join(parts[:cut])
        if block not in out:
            out.append(block)
    return ", ".join(out) or "nothing"


def layout_check(held: dict[int, list[str]], order: list[str], prefix: str) -> Check:
    """``stage layout``: each module of ``order`` (one device's) held by one stage, the stages in its order."""
    at = {n: i for i, n in enumerate(order)}
    owners: dict[str, list[int]] = {}
    for s, names in held.items():
        for n in names:
            owners.setdefault(n, []).append(s)
    summary = "; ".join(f"stage {s} holds {_short(sorted(ns, key=lambda n: at.get(n, len(at))), prefix)}"
                        for s, ns in held.items())
    why = ""
    lost = [n for n in order if n not in owners]
    twice = [n for n in order if len(owners.get(n, ())) > 1]
    if lost:
        why = f"no stage holds {_short(lost, prefix)} ({', '.join(lost[:2])}{', ...' if len(lost) > 2 else ''})"
    elif twice:
        why = f"{twice[0]} is held by stages {owners[twice[0]]}"
    else:
        idx = sorted(held)
        for a, b in zip(idx, idx[1:]):
            late = max((n for n in held[a] if n in at), key=at.get, default=None)
            early = min((n for n in held[b] if n in at), key=at.get, default=None)
            if late is not None and early is not None and at[late] > at[early]:
                why = (f"stage {a} holds {late}, which one device runs after {early} (held by stage {b}): the "
                       f"stages are not in the model's order")
                break
    return Check("stage layout", 0.0 if not why else float("inf"), 0.0, not why, f"{why}; {summary}" if why else summary)


def pipeline_checks(job: dict, groups, pipe: Pipelined, mesh, case, ref, dt: torch.dtype,
                    load_whole: Callable) -> list[Check]:
    """The checks of a pipeline case, as :func:`verify.cases.torchpar.case.run_torchpar_job` makes them
    for a module (``load_whole``: its loader of a module's parameters from whole tensors)."""
    dtype = job.get("dtype", "float32")
    params = dict(ref.named_parameters())
    rs = RankStages(pipe, mesh, params)
    ref64 = load_like(to_dtype(build_model(job["model"], job["seed"]).model, torch.float64), ref)
    layout = layout_check(rs.stages_held(), call_order(ref, cast(case.batch(0), dt)), rs.prefix)
    initial = rs.state_dict()
    checks = [layout] + [exact(f"initial {n}", initial.get(n), p.detach()) for n, p in params.items()]
    steps = ReferenceSteps.fresh(ref, ref64, rs.parameters(), dt)
    for step in range(job["steps"]):
        args = cast(case.batch(step), dt)
        checks += steps.step(step, args, rs, lambda point: rs.load(point, load_whole), lambda: rs.step(args, dt))
    opts, fallback = steps.opts, steps.fallback
    checks.append(Check("note: pp", 0.0, 0.0, True, f"{type(pipe.schedule).__name__}, {len(rs.stages_held())} stages "
                        f"over pp={rs.pp}, {pipe.schedule._n_microbatches} micro-batches; {layout.reason}"))
    undivided = loss_scale(pipe.module, token_degree(rs.mesh))[1]
    if undivided:
        checks.append(Check("note: fsdp loss scale", 0.0, 0.0, True, undivided.split(":")[0] + ": the schedule's "
                            "loss_fn divides by the global token count itself (torchtitan's), the step's loss sums "
                            "over dp"))
    if job.get("checkpoint", True) and layout.ok:  # a parameter no stage holds cannot be saved
        try:
            checks += resume_checks(job, rs, opts[0], dt, case, groups)
        except (Exception, CheckpointException) as exc:
            raise RaisedAfter(checks + fallback.notes(dtype, checks), exc, "the checkpoint resume") from exc
    return checks + fallback.notes(dtype, checks)


def _renamed(state: dict, prefix: str) -> dict:
    """Keys of the stage list's state dicts (``0.layers.0.w``; flattened optimizer ``state.0.layers.0.w.exp_avg``)
    under the model's names (``model.layers.0.w``)."""
    out = {}
    for k, v in state.items():
        head, sep, rest = k.partition(".")
        if head in ("state", "param_groups") and sep:
            out[f"{head}.{prefix}{rest.partition('.')[2]}"] = v
        else:
            out[prefix + rest] = v
    return out


def resume_checks(job: dict, rs: RankStages, opt, dt: torch.dtype, case, groups) -> list[Check]:
    """The stage modules and their AdamW saved with ``torch.distributed.checkpoint`` under the model's names
    (each stage its own keys), loaded on one device into a model built afresh: every parameter and moment
    bit for bit, then one more step of the resumed model against the pipeline's."""
    steps = job["steps"]
    path = Path(job["gen_dir"]) / f"dcp-{file_tag(job['model'])}-{file_tag(job['parallelize'])}-w{job['world_size']}-s{job['seed']}"
    everyone = groups.get(range(job["world_size"]))
    if dist.get_rank() == 0 and path.exists():
        shutil.rmtree(path)
    dist.barrier(group=everyone)
    saved, saved_moments = rs.state_dict(), rs.moments(opt)
    parts = rs.pipe.module
    model_state, via = model_state_dict(parts)
    dcp.save({"model": _renamed(model_state, rs.prefix),
              "optim": _renamed(get_optimizer_state_dict(parts, opt, options=FLAT), rs.prefix)},
             checkpoint_id=path, process_group=everyone)
    dist.barrier(group=everyone)
    single = to_dtype(build_model(job["model"], job["seed"]).model, dt)
    single_opt = torch.optim.AdamW(single.parameters(), lr=opt.defaults["lr"])
    state = {"model": get_model_state_dict(single) if via is None else single.state_dict(),
             "optim": get_optimizer_state_dict(single, single_opt, options=FLAT)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)
    if via is None:
        set_model_state_dict(single, state["model"])
    else:
        single.load_state_dict(state["model"])
    set_optimizer_state_dict(single, single_opt, state["optim"], options=FLAT)
    checks = [Check("note: resume", 0.0, 0.0, True, via)] if via else []
    checks += [exact(f"resumed on one device: param {n}", p.detach(), saved.get(n)) for n, p in single.named_parameters()]
    names = {id(p): n for n, p in single.named_parameters()}
    moments = {names[id(p)]: st for p, st in single_opt.state.items()}
    checks += [exact(f"resumed on one device: optimizer {k} of {n}", moments.get(n, {}).get(k), t)
               for n, st in saved_moments.items() for k, t in st.items()]
    args = cast(case.batch(steps), dt)
    single64 = load_like(to_dtype(build_model(job["model"], job["seed"]).model, torch.float64), single)
    params = dict(single.named_parameters())  # the resumed model is the shadow, its AdamW fed the parallel gradients
    resumed = ReferenceSteps(single, single64, dt, [opt, single_opt], params).step(
        steps, args, rs, None, lambda: rs.step(args, dt))
    return checks + [Check(f"resumed on one device: {c.name}", c.err, c.tol, c.ok, c.reason) for c in resumed]
