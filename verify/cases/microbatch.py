"""Micro-batches in the harness: the whole batch of a micro-batched step, the loss function that makes
a model's mean loss exact across uneven micro-batches, and one rank's part of an accumulation case
(two or more backward passes before one optimizer step, with and without ``no_sync``, or one
``train_step``), judged against one device on the whole batch."""
from __future__ import annotations

import importlib.util
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from nnscaler.policies import ComputeConfig
from nnscaler.runtime.mesh import GroupCache

from verify.cases.compiled import compile_case
from verify.cases.batch import share
from verify.cases.batch import cast
from verify.judge.compare import Check, check_tensor
from verify.models.registry import ModelCase
from verify.cases.fresh import built_like
from verify.cases.reference import SharedReference, reference_grads
from verify.models.loader import build_model
from verify.models.loader import file_tag


def whole_batch(batch: Callable[[int], tuple], step: int, microbatches: int) -> tuple:
    """The batch of micro-batched step ``step``: the model's batches ``step * M .. step * M + M - 1``
    stacked along dim 0 (each is then one micro-batch, of the shapes the model's plans are made for);
    arguments without a dim 0 come from the first."""
    parts = [batch(step * microbatches + i) for i in range(microbatches)]
    if microbatches == 1:
        return parts[0]
    return tuple(torch.cat([p[k] for p in parts]) if isinstance(a, torch.Tensor) and a.dim() > 0 else a
                 for k, a in enumerate(parts[0]))


def one_device_loss(model: torch.nn.Module, args: tuple, microbatches: int, case: ModelCase) -> torch.Tensor:
    """The single-device reference of a micro-batched step: the same recipe on one device, its M
    micro-batches (the model's batches of :func:`whole_batch`) run one by one and their losses
    weighted as ``train_step`` weighs them (by rows; by ``case.loss_count`` where the model gives it).
    Where the loss is a mean over independent samples this equals the loss of the whole batch; where
    the loss couples the samples of a batch (a contrastive loss), only this is the recipe's
    reference: gradient accumulation trains each micro-batch's loss on its own."""
    if microbatches == 1:
        return model(*args)
    rows = next(a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() > 0)
    parts = [tuple(a.chunk(microbatches)[i] if isinstance(a, torch.Tensor) and a.dim() > 0 else a for a in args)
             for i in range(microbatches)]
    weights = [case.loss_count(*p) for p in parts] if case.loss_count is not None else \
        [next(a.shape[0] for a in p if isinstance(a, torch.Tensor) and a.dim() > 0) for p in parts]
    total = sum(float(w) for w in weights) if case.loss_count is not None else rows
    return sum(model(*p) * w for p, w in zip(parts, weights)) / total


def loss_fn_of(case: ModelCase):
    """``train_step``'s loss function for ``case``: ``None`` (the model's mean loss, weighted by rows)
    unless the model says how many elements its loss averages (``ModelCase.loss_count``); then
    ``(loss * count, count)``, so micro-batches with fewer real targets weigh less."""
    if case.loss_count is None:
        return None

    def loss_fn(out, *args):
        count = case.loss_count(*args)
        return out * count, count
    return loss_fn


def run_accumulation_job(job: dict, groups: GroupCache) -> list[Check]:
    """``kind: accumulation``: model ``model`` planned by ``policy`` on ``plan_ngpus`` ranks, run on
    ``world_size`` (the rest data-parallel replicas, each fed its share), one step of ``microbatches``
    micro-batches, then every gradient (and for ``train_step`` the loss) against one device on the
    whole batch. ``mode``: ``no_sync`` (the user's loop: backward of each micro-batch's loss / M,
    ``no_sync`` around all but the last), ``synced`` (the same loop without ``no_sync``: gradients
    synced after every backward), ``train_step``. With ``mutant`` (a name) and ``catalog`` (a file or a
    package folder with a context manager ``applied(name)``, as ``tests/mutants/catalog/``), the case runs with that bug
    put into the compiler or runtime, and without it again afterwards: the tests prove so, on the
    shared rank gang, that the harness catches it."""
    with _mutated(job.get("catalog"), job.get("mutant")):
        return _accumulation_checks(job, groups)


def _mutated(catalog: str | None, name: str | None):
    if not name:
        return nullcontext()
    module = sys.modules.get("verify_mutant_catalog")
    if module is None:
        path = Path(catalog)
        if path.is_dir():  # a package: its modules import each other relatively, under this name
            spec = importlib.util.spec_from_file_location("verify_mutant_catalog", path / "__init__.py",
                                                          submodule_search_locations=[str(path)])
        else:
            spec = importlib.util.spec_from_file_location("verify_mutant_catalog", catalog)
        module = importlib.util.module_from_spec(spec)
        sys.modules["verify_mutant_catalog"] = module  # before running it: relative imports look here
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules["verify_mutant_catalog"]
            raise
    return module.applied(name)


def _accumulation_checks(job: dict, groups: GroupCache) -> list[Check]:
    name, policy, mode, m, seed = job["model"], job["policy"], job["mode"], job["microbatches"], job["seed"]
    world, plan_ngpus = job["world_size"], job.get("plan_ngpus", job["world_size"])
    case = build_model(name, seed)
    reference = SharedReference.of(groups, world)  # computed on rank 0 alone (verify/cases/reference.py)
    if reference.computes:
        ref64 = built_like(name, seed, case.model, torch.float64)
        ref = built_like(name, seed, case.model)
    replicas, replica = world // plan_ngpus, dist.get_rank() // plan_ngpus
    full = whole_batch(case.batch, 0, m)
    mine = share(full, replica, replicas)
    config = ComputeConfig(plan_ngpus, runtime_ngpus=world, seed=seed, tp_size=2 if plan_ngpus % 2 == 0 else 1,
                           num_microbatches=m if mode == "train_step" else 1)
    sample = mine if mode == "train_step" else share(case.batch(0), replica, replicas)
    pm = compile_case(case.model, sample, policy, config, groups,
                      Path(job["gen_dir"]) / f"{file_tag(name)}-{policy}-p{plan_ngpus}-w{world}-{mode}{m}-s{seed}")
    checks = []
    loss_fn = loss_fn_of(case)
    if mode == "train_step":
        loss = pm.train_step(*mine, loss_fn=loss_fn)
    else:
        for i in range(m):
            mb = share(case.batch(i), replica, replicas)
            with pm.no_sync() if mode == "no_sync" and i < m - 1 else nullcontext():
                (pm(*mb) / m).backward()
    def one_device() -> dict:
        loss_ref = ref(*full)
        loss64 = ref64(*cast(full, torch.float64))
        loss_ref.backward()
        loss64.backward()
        grads, grads64 = reference_grads(dict(ref.named_parameters()), ref64)
        return {"loss": loss_ref.detach(), "loss64": loss64.detach(), "grads": grads, "grads64": grads64}

    one = reference.share(one_device)
    if mode == "train_step":
        checks.append(check_tensor("loss", loss, one["loss"], one["loss64"]))
    grads = pm.whole_grads()
    scale = max((float(g.abs().max()) for g in one["grads64"].values() if g is not None), default=0.0)
    for n, g in one["grads"].items():
        checks.append(check_tensor(f"grad {n}", grads.get(n), g, one["grads64"][n], scale=scale))
    return checks
