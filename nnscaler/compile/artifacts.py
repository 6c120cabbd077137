"""The generated programs on disk: one file per plan rank under ``gen_savedir``, keyed by a digest of
everything that shapes them, and imported from their own text (never re-read from disk)."""
from __future__ import annotations

import hashlib
import sys
import types
from pathlib import Path

import torch

from ..codegen.emit import Emitter, render_program
from ..io import atomic_write, locked
from ..ir.graph import IRGraph
from ..ir.plan import Plan
from ..recipe import Recipe
from ..runtime.mesh import RankMesh
from ..runtime.module import ParallelModule

CODEGEN_VERSION = "2"


class GenSaveDirError(OSError):
    """``gen_savedir`` cannot hold the generated programs (not a directory, not writable)."""


def program_digest(*parts: str) -> str:
    """The key of a generated program: the code generator's version and every part that shapes it."""
    return hashlib.sha256("\n".join([CODEGEN_VERSION, *parts]).encode()).hexdigest()


def import_program(source: str, path: Path, plan_rank: int):
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


def _same(path: Path, text: str) -> bool:
    try:
        return path.read_bytes() == text.encode()
    except OSError:
        return False


def save_program(directory: Path, plan_rank: int, source: str, reuse: bool) -> Path:
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
        with locked(directory):
            if not (reuse and _same(path, source)):
                atomic_write(path, source)
    except OSError as exc:
        raise GenSaveDirError(f"gen_savedir {str(directory)!r} is not writable: {exc.strerror or exc}") from None
    return path


def persistent_names(model: torch.nn.Module) -> frozenset[str]:
    """The names ``model.state_dict()`` lists (its parameters and persistent buffers, aliases included)."""
    return frozenset(model.state_dict(keep_vars=True))


def load_program(graph: IRGraph, plan: Plan, emitted: Emitter, *, plan_rank: int, key: list[str], label: str,
                 directory: Path, reuse: bool) -> tuple[types.ModuleType, str]:
    """Plan rank ``plan_rank``'s program written down, saved under ``directory`` and imported, and its
    digest (the same on every rank of one graph, plan and ``key``)."""
    digest = program_digest(str(graph), plan.describe(), repr(plan.mesh_shape), *key)
    source = render_program(emitted, header=f"[{digest}] {label}: ")
    path = save_program(directory, plan_rank, source, reuse)  # a gen_savedir that cannot be used fails here
    return import_program(source, path, plan_rank), digest


def build_rank_module(model: torch.nn.Module, graph: IRGraph, plan: Plan, emitted: Emitter, *, plan_rank: int,
                      key: list[str], label: str, directory: Path, reuse: bool, mesh: RankMesh, replica_group,
                      replicas: int, recipe: Recipe, zero=None) -> ParallelModule:
    """Plan rank ``plan_rank``'s program (emitted once, by the caller) written down, saved, imported and
    wrapped with this rank's state: the one path from a plan to a module, for whole models and stages.
    ``key``: what else shapes the program (config, policy, stage), hashed into its header; ``recipe``:
    the training recipe, handed to the module whole; ``zero``: this rank's ZeRO layout."""
    program, _ = load_program(graph, plan, emitted, plan_rank=plan_rank, key=key, label=label, directory=directory,
                              reuse=reuse)
    state = {**graph.constants, **dict(model.named_buffers()), **dict(model.named_parameters())}
    trainable = {n for n, _ in model.named_parameters()}
    module = ParallelModule(program, state, mesh, trainable, replica_group, replicas, recipe=recipe, zero=zero,
                            persistent=persistent_names(model))
    module.plan, module.graph = plan, graph
    return module
