"""The parallel model of a torch-parallelization case: the user's ``fn`` found, the model built
afresh with its single-device twin, and ``fn`` applied on the mesh."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from verify.cases.fresh import load_like
from verify.judge.dtypes import to_dtype
from verify.api import Parallelized, unpack
from verify.cases.torchpar.fsdp import sum_reductions_on_gloo
from verify.models.loader import ModelNotFound, build_model, import_file


class ParallelizeNotFound(ValueError):
    """``--parallelize FILE.py:fn`` names no file or no function (exit 2 before ranks start)."""


def find_fn(ref: str) -> Callable:
    """``fn`` of ``FILE.py:fn`` (the file imported once per process, as model builders are)."""
    path, sep, name = ref.rpartition(":")
    if not sep or not path.endswith(".py") or not name:
        raise ParallelizeNotFound(f"--parallelize {ref!r}: give FILE.py:function")
    p = Path(path)
    if not p.is_file():
        raise ParallelizeNotFound(f"--parallelize {ref!r}: no such file {path}")
    try:
        module = import_file(p.resolve())
    except ModelNotFound as exc:  # the file raised on import: said in one line
        raise ParallelizeNotFound(f"--parallelize {ref!r}: {exc}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ParallelizeNotFound(f"--parallelize {ref!r}: {path} has no function {name!r} (it must be "
                                  f"fn(model, mesh) -> module)")
    return fn


def parallel_model(model_ref: str, fn_ref: str, seed: int, dt: torch.dtype, mesh) -> tuple[Parallelized, object]:
    """``fn`` applied to model ``model_ref`` built afresh in ``dt``; with ``(case, twin)``: the case (its
    batches) and the single-device model built afresh holding the same initial state."""
    case = build_model(model_ref, seed)
    to_dtype(case.model, dt)
    ref = to_dtype(build_model(model_ref, seed).model, dt)
    load_like(ref, case.model)
    par = unpack(find_fn(fn_ref)(case.model, mesh), fn_ref)
    sum_reductions_on_gloo(par.module)  # reductions gloo lacks, as torch emulates them (verify/cases/torchpar/fsdp.py)
    return par, (case, ref)
