"""Verify your own torch parallelization from Python: ``verify_parallelization(build, fn)`` is
``python -m verify model FILE.py:build --parallelize FILE.py:fn`` (the contract:
:mod:`verify.api`). ``Parallelized`` is what ``fn`` returns when each step must run in
a context (``loss_parallel``); ``Pipelined`` what it returns for a pipeline (stages and their schedule)."""
from __future__ import annotations

import inspect
import math
import tempfile
from typing import Callable, Sequence

from verify.config import RunConfig

from verify.judge.row import Row
from verify.api import Parallelized, ParallelizeError, Pipelined
from verify.cases.torchpar.mesh import parse_mesh
from verify.rows.torchpar import check_parallelize, run_torchpar
from verify.runner.gang import Gang

__all__ = ["Parallelized", "ParallelizeError", "Pipelined", "reference", "verify_parallelization"]


def reference(obj: str | Callable, what: str) -> str:
    """``FILE.py:name`` for a function (the ranks import its file themselves), or the string as given."""
    if isinstance(obj, str):
        return obj
    try:
        path = inspect.getsourcefile(obj)
    except TypeError:
        path = None
    if path is None or not hasattr(obj, "__name__"):
        raise ParallelizeError(f"{what}: cannot find the file that defines {obj!r}; pass 'file.py:{what}'")
    return f"{path}:{obj.__name__}"


def verify_parallelization(build: str | Callable, fn: str | Callable, *, mesh: str = "tp",
                           world_sizes: Sequence[int] | None = None, seeds: Sequence[int] = (0,), steps: int = 3,
                           dtype: str = "float32", gang: Gang | None = None) -> list[Row]:
    """Rows of ``build`` (``FILE.py:builder`` or the builder) parallelized by ``fn`` (``FILE.py:fn`` or
    the function) on a ``mesh`` (``"tp"``, ``"dp"``, ``"dp=2,tp=2"``) at each world size (default: the
    mesh's product when its sizes are fixed, else 2), trained ``steps`` AdamW steps against one
    device and resumed on one device from a DCP checkpoint. Bad input raises (a ``ValueError``)
    before any rank starts; ``gang``: ranks to reuse (else started and stopped here)."""
    model, fn_ref = reference(build, "build"), reference(fn, "fn")
    if world_sizes is None:
        dims = parse_mesh(mesh)
        world_sizes = [math.prod(s for _, s in dims)] if all(s for _, s in dims) else [2]
    dims = check_parallelize(model, fn_ref, mesh, list(world_sizes))
    cfg = RunConfig(world_sizes=tuple(world_sizes), seeds=tuple(seeds), dtype=dtype)
    with tempfile.TemporaryDirectory() as tmp:
        if gang is not None:
            return list(run_torchpar(gang, model, fn_ref, dims, cfg, tmp, steps))
        with Gang(max(world_sizes), world_sizes=list(world_sizes)) as own:
            return list(run_torchpar(own, model, fn_ref, dims, cfg, tmp, steps))
