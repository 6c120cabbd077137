"""The first divergent operator of a whole-model case that mismatches.

The parallel program is generated again in instrumented mode (every operator's output handed to a
probe), run on the case's ranks on one batch, and every output and every output's gradient brought
back to the whole layout. The same traced graph is run on one device through a one-rank plan of the
same generator, in the dtype under test and in float64. Tensor by tensor, with the tolerance policy
of :mod:`verify.judge.compare`, the first operator in program order whose output leaves tolerance is the
forward culprit; when every output is right, the first gradient to leave tolerance in backward
order (latest operator first) names the operator whose backward broke it.
"""
from __future__ import annotations

import importlib.util
import math
import shlex
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nnscaler.codegen.emit import generate
from nnscaler import parallelize
from nnscaler.policies import ComputeConfig
from nnscaler.trace.build import UnknownOperatorWarning
from nnscaler.dimops.layout import Partial, Shard, join_blocks
from nnscaler.ir.graph import IRGraph
from nnscaler.ops.registry import DEFAULT_REGISTRY
from nnscaler.ir.plan import Plan, replicated
from nnscaler.runtime.module import ParallelModule
from nnscaler.runtime.mesh import RankMesh

from verify.models.loader import file_tag
from verify.judge.compare import check_tensor
from verify.plan.check import op_partition
from verify.cases.fresh import built_like
from verify.models.loader import build_model
from verify.cases.samples import DTYPES
from verify.judge.verdict import Divergence


def _import_source(source: str, tag: str):
    """Import a generated program (instrumented programs are never cached on disk)."""
    path = Path(tempfile.mkdtemp(prefix="nnscaler-probe-")) / f"{tag}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"nnscaler_probe_{tag}_{id(path)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Recorder:
    """The ``probe`` of an instrumented program: keeps each output and, in backward, its gradient."""

    def __init__(self) -> None:
        self.order: list[tuple[str, str, str]] = []  # (op, tensor, layout) in program order
        self.values: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}

    def __call__(self, op: str, name: str, value: Any, layout: str) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        self.order.append((op, name, layout))
        self.values[name] = value.detach().clone()
        if value.requires_grad:
            value.register_hook(lambda g, name=name: self.grads.__setitem__(name, g.detach().clone()))
        return value


def _placements(layout: str) -> list:
    out = []
    for q in layout.split("x"):
        out.append(Shard.parse(q) if q.startswith("D") else Partial() if q == "V" else None)
    return out


def _whole(x: torch.Tensor, layout: str, groups, grad: bool) -> torch.Tensor:
    """The whole tensor from this rank's piece (every rank calls this in the same order). A
    gradient is split like its tensor, but whole where the tensor is a partial value."""
    places = _placements(layout)
    for axis in reversed(range(len(places))):
        q, group = places[axis], groups[axis]
        if group is None:
            continue
        if isinstance(q, Shard):
            parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, x.contiguous(), group=group)
            x = join_blocks(parts, q.dim, q.blocks)
        elif isinstance(q, Partial) and not grad:
            x = x.clone()
            dist.all_reduce(x, group=group)
    return x


def _run(program, state: dict, groups, args: tuple) -> Recorder:
    rec = Recorder()
    loss = program.forward(state, groups, *args, probe=rec)
    loss.backward()
    return rec


def single_program(graph: IRGraph, model: torch.nn.Module, dtype: torch.dtype | None = None):
    """``graph`` generated for one device (instrumented) and its state, in ``dtype`` (``None``: as traced)."""
    plan = Plan((1,), ("r",), {op.name: replicated((1,)) for op in graph.ops if op.known}, policy="single")
    source, _, _ = generate(graph, plan, 0, probe=True)
    if dtype == torch.float64:  # the float64 reference of the same graph: its dtype literals follow
        for low in ("torch.float32", "torch.bfloat16", "torch.float16"):
            source = source.replace(low, "torch.float64")
    program = _import_source(source, "single")
    state = {**graph.constants, **dict(model.named_buffers()), **dict(model.named_parameters())}
    state = {k: v.detach().clone().requires_grad_(isinstance(v, torch.nn.Parameter) and v.requires_grad) for k, v in state.items()}
    if dtype is not None:
        state = {k: (v.detach().to(dtype).requires_grad_(v.requires_grad) if v.is_floating_point() else v)
                 for k, v in state.items()}
    return program, state


def single_device(graph: IRGraph, model: torch.nn.Module, args: tuple, dtype: torch.dtype | None) -> Recorder:
    """Every output and output gradient of ``graph`` run on one device on ``args``, in ``dtype``."""
    program, state = single_program(graph, model, dtype)
    if dtype is not None:
        args = tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    return _run(program, state, (None,), args)


def rerun_command(op, plan: Plan, world_size: int, model: str, seed: int, dtype: str) -> str:
    """``verify op`` for ``op`` alone under its plan partition (``--module`` files are the caller's):
    a registered operator by name, at its sample lengths; any other annotated operator as node
    ``op.name`` of ``model`` traced in ``dtype`` with ``seed`` (:mod:`verify.cases.node`)."""
    if not op.known:
        return ""
    registered = op.spec.name in DEFAULT_REGISTRY and DEFAULT_REGISTRY.get(op.spec.name) is op.spec
    what = [op.spec.name] if registered or not model else ["--model", model, "--node", op.name]
    return " ".join(shlex.quote(p) for p in ["python", "-m", "verify", "op", *what, "--world-size", str(world_size),
                                             "--partition", op_partition(plan, op).label, "--seed", str(seed),
                                             "--dtype", dtype])


def probed_program(graph: IRGraph, plan: Plan, mesh: RankMesh, model: torch.nn.Module):
    """This rank's instrumented program of ``plan`` and its local state (the model's tensors)."""
    rank = mesh.rank - mesh.offset
    source, _, _ = generate(graph, plan, rank, probe=True)
    program = _import_source(source, f"rank{rank}")
    probed = ParallelModule(program, {**graph.constants, **dict(model.named_buffers()),
                                      **dict(model.named_parameters())}, mesh,
                            {n for n, _ in model.named_parameters()})
    return program, probed._local()


def first_bad(par: Recorder, dev: Recorder, ref: Recorder, groups) -> tuple[str, str, Any] | None:
    """``(op, direction, check)`` of the first tensor of ``par`` (a run on ranks whose mesh groups are
    ``groups``; every one of them calls this) that leaves tolerance against the single-device runs
    ``dev`` and ``ref``: outputs in program order, then gradients latest first."""
    scale = max((float(g.abs().max()) for g in ref.grads.values() if g.numel()), default=0.0)

    def check(name, layout, direction):
        if direction == "forward":
            whole = _whole(par.values[name], layout, groups, grad=False)
            return check_tensor(name, whole, dev.values.get(name), ref.values.get(name))
        g = par.grads.get(name)
        whole = None if g is None else _whole(g, layout, groups, grad=True)
        return check_tensor(name, whole, dev.grads.get(name), ref.grads.get(name), scale=scale)

    found = None
    for op_name, name, layout in par.order:  # every rank gathers every tensor, in the same order
        c = check(name, layout, "forward")
        if found is None and not c.ok:
            found = (op_name, "forward", c)
    if found is None:
        for op_name, name, layout in reversed(par.order):
            c = check(name, layout, "backward")
            if found is None and not c.ok:
                found = (op_name, "backward", c)
    return found


def divergence(graph: IRGraph, plan: Plan, found: tuple[str, str, Any], world_size: int, model_ref: str = "",
               seed: int = 0, dtype: str = "float32", where: str = "") -> Divergence:
    """The :class:`Divergence` of ``first_bad``'s answer for ``plan`` on ``world_size`` ranks."""
    op_name, direction, c = found
    op = next(o for o in graph.ops if o.name == op_name)
    label = plan.partition(op).label if op.known else "replicate (no annotation)"
    rerun = rerun_command(op, plan, world_size, model_ref, seed, dtype)
    name = op.spec.name if op.known else op.overload
    return Divergence(op_name, name if name == op.overload else f"{op.overload}, registered as {name}", op.source,
                      label, direction, c.err if math.isfinite(c.err) else float("inf"), c.tol, rerun, where)


def first_divergence(pm: ParallelModule, model: torch.nn.Module, args: tuple, world_size: int, model_ref: str = "",
                     seed: int = 0, dtype: str = "float32") -> Divergence | None:
    """Run ``pm``'s plan instrumented on ``args`` (every rank of the plan calls this) and compare
    each operator with the single-device run of the same graph; ``None`` if none diverges.
    ``model_ref``, ``seed`` and ``dtype`` name the traced model for the culprit's rerun command."""
    graph, plan, mesh = pm.graph, pm.plan, pm.mesh
    program, local = probed_program(graph, plan, mesh, model)
    par = _run(program, local, mesh.groups, args)
    dev, ref = single_device(graph, model, args, None), single_device(graph, model, args, torch.float64)
    found = first_bad(par, dev, ref, mesh.groups)
    return None if found is None else divergence(graph, plan, found, world_size, model_ref, seed, dtype)


def as_dict(d: Divergence | None) -> dict | None:
    return None if d is None else asdict(d)


def localize_model_case(name: str, policy: str, world_size: int, seed: int, groups, gen_dir: str,
                        dtype: str = "float32") -> Divergence | None:
    """The first divergent operator of model ``name`` under ``policy`` (a built-in name or
    ``FILE.py:fn``), on its step-0 batch and initial parameters, in ``dtype`` (every rank of the case
    calls this, after the case mismatched)."""
    from verify.cases.model import resolve_policy  # model_case imports the gang's worker, which imports this
    dt = DTYPES[dtype]
    case = build_model(name, seed)
    model = case.model.to(dt)
    args = tuple(a.to(dt) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in case.batch(0))
    config = ComputeConfig(world_size, tp_size=2 if world_size % 2 == 0 else 1, seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnknownOperatorWarning)
        pm = parallelize(built_like(name, seed, model, dt), args, resolve_policy(policy), config, groups=groups, verify=False,
                         gen_savedir=Path(gen_dir) / f"localize-{file_tag(name)}-{file_tag(policy)}-w{world_size}-s{seed}")
    return first_divergence(pm, model, args, world_size, name, seed, dtype)
