"""The parent's side of torch-parallelization cases: the checks before any rank starts (``fn``
exists, returns a module with the model's parameter names on a mesh of the asked shape: run once on
a fake process group, as torchtitan's dry runs do) and the rows of a run on the gang."""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from verify.config import RunConfig

from verify.judge.row import Row
from verify.kinds.torchpar import Torchpar
from verify.cases.torchpar.build import ParallelizeNotFound, find_fn
from verify.api import ParallelizeError, Pipelined, unpack
from verify.cases.torchpar.gang_mesh import cpu_meshes
from verify.cases.torchpar.mesh import DATA, MeshSpecError, mesh_shape, parse_mesh
from verify.cases.torchpar.names import named_parameters
from verify.cases.torchpar.pipeline import check_pipeline
from verify.judge.verdict import ERROR, MATCH, Divergence, judge, worst
from verify.models.loader import build_model
from verify.runner.gang import Gang

BAD_INPUT = (ParallelizeNotFound, ParallelizeError, MeshSpecError)


def mesh_label(names, sizes) -> str:
    return ",".join(f"{n}={s}" for n, s in zip(names, sizes))


def check_parallelize(model: str, fn_ref: str, mesh_spec: str, world_sizes) -> tuple:
    """Before any rank starts: the mesh spec fits every world size, ``fn`` exists and, called on a
    fresh build of the model over a fake process group of the first world size (rank 0; no
    communication happens), returns a module (or ``Parallelized``) with the model's parameter
    names. Raises one of :data:`BAD_INPUT`; returns the parsed mesh dims."""
    dims = parse_mesh(mesh_spec)
    for w in world_sizes:
        mesh_shape(dims, w)
    fn = find_fn(fn_ref)
    rows = [a.shape[0] for a in build_model(model, 0).batch(0) if isinstance(a, torch.Tensor) and a.dim()]
    for w in world_sizes:
        names, sizes = mesh_shape(dims, w)
        data = [(n, s) for n, s in zip(names, sizes) if n in DATA]
        dp = math.prod(s for _, s in data)
        if any(r % dp for r in rows):
            what = " x ".join(n for n, _ in data)
            raise MeshSpecError(f"--mesh {mesh_label(names, sizes)}: the batch ({rows[0]} rows) does not divide over "
                                f"{what}={dp}; each {what} rank takes an equal slice of it")
    if dist.is_initialized():  # this process has its own group (a user's): the ranks will say the rest
        return dims
    from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's fake backend (dry runs)
    names, sizes = mesh_shape(dims, world_sizes[0])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_sizes[0])
    try:
        built = build_model(model, 0).model
        want = sorted(n for n, _ in built.named_parameters())
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
        try:
            with cpu_meshes():  # torchtitan lays its meshes for cuda where it finds no device
                par = unpack(fn(built, mesh), fn_ref)
        except ParallelizeError:
            raise
        except Exception as exc:
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ParallelizeError(f"--parallelize {fn_ref}: fn(model, mesh) raised {type(exc).__name__}: {text} "
                                   f"(on a {mesh_label(names, sizes)} mesh)") from None
        if isinstance(par, Pipelined):  # this rank's stages: their names under one prefix, a pp dimension
            check_pipeline(par, names, want, fn_ref)
            return dims
        got = sorted(n for n, _ in named_parameters(par.module))
        if got != want:
            lost = sorted(set(want) - set(got))[:3]
            raise ParallelizeError(f"--parallelize {fn_ref}: the module it returns lacks parameters of the model "
                                   f"({', '.join(lost) or 'renamed'}); return the model (or a module with its "
                                   f"parameter names)")
    finally:
        dist.destroy_process_group()
    return dims


def expected_checks(model: str, steps: int, checkpoint: bool = True) -> list[str]:
    """Checks every rank must return (a short list fails the case)."""
    params = [n for n, _ in build_model(model, 0).model.named_parameters()]
    names = [f"initial {n}" for n in params]
    for s in range(steps):
        names += [f"load step {s}", f"loss step {s}", *(f"grad {n} step {s}" for n in params),
                  *(f"param {n} after step {s}" for n in params)]
    if checkpoint:
        names += [f"resumed on one device: param {n}" for n in params]
        names += [f"resumed on one device: loss step {steps}", *(f"resumed on one device: grad {n} step {steps}"
                                                                for n in params)]
    return names


RESUME_RAISED = "the checkpoint resume raised"  # verify/cases/torchpar/case.py: training was judged in full
BUILD_RAISED = "fn(model, mesh) on the ranks raised"  # verify/cases/torchpar/case.py: no step ran, nothing to localise


def localize_error(gang: Gang, job: dict, cfg: RunConfig) -> str:
    """Where a case that raised parted from one device before it raised: the localiser run as a job of
    its own on the (restarted) gang, all ranks in step, judging every module up to the exception
    (``"; "`` and the module, or ``""`` when the localiser itself could not run)."""
    answers = gang.run(dict(job, steps=0, checkpoint=False, localize=True), job["world_size"], cfg.limit_s("model", 1))
    result = answers[0].result or {}
    if result.get("divergence"):
        return "; before it raised, the " + Divergence(**result["divergence"]).describe()
    return f"; {result['divergence_note']}" if result.get("divergence_note") else ""


def run_torchpar(gang: Gang, model: str, fn_ref: str, dims, cfg: RunConfig, gen_dir: str, steps: int = 3,
                 skip: frozenset | set = frozenset(), label: str | None = None, checkpoint: bool = True) -> Iterator[Row]:
    """Train ``model`` parallelized by ``fn_ref`` on each world size and seed of ``cfg``; one row per
    case (``label``: the partition column, by default the function and the mesh)."""
    fn_ref = str(Path(fn_ref.rpartition(":")[0]).resolve()) + ":" + fn_ref.rpartition(":")[2]
    for seed in cfg.seeds:
        for w in cfg.world_sizes:
            names, sizes = mesh_shape(dims, w)
            mesh = mesh_label(names, sizes)
            part = label or f"{fn_ref.rpartition(':')[2]} [{mesh}]"
            if (f"model:{model}", w, part, cfg.dtype, seed) in skip:
                continue
            start = time.perf_counter()
            job = {"kind": "torchpar", "model": model, "parallelize": fn_ref, "mesh": [[n, s] for n, s in zip(names, sizes)],
                   "world_size": w, "steps": steps, "seed": seed, "gen_dir": gen_dir, "dtype": cfg.dtype,
                   "checkpoint": checkpoint}
            answers = gang.run(job, w, cfg.limit_s("model", steps))
            status, detail, checks, tb = judge(answers, expected_checks(model, steps, checkpoint))
            if status == ERROR and not any(where in detail for where in (RESUME_RAISED, BUILD_RAISED)):
                detail += localize_error(gang, job, cfg)
            out = worst([c for c in checks if not c["name"].startswith("grad")], "")
            grad = worst(checks, "grad")
            yield Row(f"model:{model}", "torchpar", f"{steps} AdamW steps vs one device, DCP resume", w, part,
                      cfg.dtype, seed, status, out and out["err"], out and out["tol"], grad and grad["err"],
                      grad and grad["tol"], detail,
                      "" if status == MATCH else Torchpar.rerun_command(cfg, model, fn_ref, mesh, w, seed, steps),
                      time.perf_counter() - start, tb)
