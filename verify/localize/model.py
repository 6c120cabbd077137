"""Where a whole-model case that mismatches first leaves the single-device program.

The parallel program is generated again in instrumented mode (:mod:`nnscaler.codegen.probe`: every
operator's output, every chain of conversion steps and every tensor an operator reads handed to a
probe), run on the case's ranks on one batch, and each record is made whole from its pieces by its
layout and compared with the same record of the same traced graph run on one device, in the dtype
under test and in float64 (under :class:`~verify.judge.compare.Float64Fallback`, bounded as the case
is): values in program order, then gradients latest first (:mod:`verify.localize.tensor_trace`). The
first one beyond its bound names an operator (its inputs match, its output does not; or its output's
gradient matches and its input's does not) or a conversion between operators (a composition fault:
every operator alone is right), with its layouts and steps.
"""
from __future__ import annotations

import importlib.util
import math
import shlex
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from nnscaler.codegen.emit import generate
from nnscaler.policies import ComputeConfig
from nnscaler.ir.graph import IRGraph
from nnscaler.ops.registry import DEFAULT_REGISTRY
from nnscaler.ir.plan import Plan, replicated
from nnscaler.runtime.module import ParallelModule
from nnscaler.runtime.mesh import RankMesh

from verify.cases.compiled import compile_case
from verify.cases.batch import cast
from verify.judge.dtypes import convert, to_dtype
from verify.models.loader import file_tag
from verify.judge.compare import Float64Fallback
from verify.cases.op import op_partition
from verify.cases.draws import same_draws
from verify.cases.fresh import built_like
from verify.localize.eager import eager_step, graph_differs, program_writes, step_zero_check, unlocalised
from verify.models.loader import build_model
from verify.cases.samples import DTYPES
from verify.localize.tensor_trace import Recorder, Trace, chain_of, compare, reads_by, reads_of
from verify.judge.verdict import Divergence

IN_STEP_ZERO = ("every tensor of the program on step 0 (values forward, gradients backward) matches the "
                "single-device run: the divergence lies after backward (gradient sync of parameters, the "
                "optimizer step), in a later step or in a checkpoint reload")


@dataclass
class Localized:
    """What localisation found: the culprit, or a line saying where else the fault lies, and the
    per-tensor error/bound profile along the program (``[label, F|B, err, tol]``)."""

    found: Divergence | None = None
    note: str = ""
    profile: list = field(default_factory=list)

    def result(self) -> dict:
        """The keys a rank's answer carries (read by :func:`verify.judge.verdict.judge` and the rows)."""
        out: dict = {"divergence_profile": self.profile}
        if self.found is not None:
            out["divergence"] = asdict(self.found)
        if self.note:
            out["divergence_note"] = self.note
        return out


def _import_source(source: str, tag: str):
    """Import a generated program (instrumented programs are never cached on disk)."""
    path = Path(tempfile.mkdtemp(prefix="nnscaler-probe-")) / f"{tag}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"nnscaler_probe_{tag}_{id(path)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(program, state: dict, groups, args: tuple) -> Recorder:
    """One forward (from one generator state, as every run compared: dropout masks equal) and backward."""
    rec = Recorder()
    with same_draws(0, 0):
        loss = program.forward(state, groups, *args, probe=rec)
    loss.backward()
    return rec


def single_program(graph: IRGraph, model: torch.nn.Module, dtype: torch.dtype | None = None):
    """``graph`` generated for one device (instrumented) and its state, in ``dtype`` (``None``: as traced)."""
    plan = Plan((1,), ("r",), {op.name: replicated((1,)) for op in graph.ops if op.known}, policy="single")
    source, _, _ = generate(graph, plan, 0, probe=True)
    program = _import_source(source, "single")
    state = {**graph.constants, **dict(model.named_buffers()), **dict(model.named_parameters())}
    state = {k: v.detach().clone().requires_grad_(isinstance(v, torch.nn.Parameter) and v.requires_grad) for k, v in state.items()}
    if dtype is not None:
        state = {k: (convert(v.detach(), dtype).requires_grad_(v.requires_grad) if v.is_floating_point() or v.is_complex() else v)
                 for k, v in state.items()}
    return program, state


def single_device(graph: IRGraph, model: torch.nn.Module, args: tuple, dtype: torch.dtype | None,
                  fallback: Float64Fallback | None = None) -> Recorder:
    """Every record of ``graph`` run on one device on ``args``, in ``dtype``; in float64 under
    ``fallback`` (the float64 reference's mode: float32 islands promoted, as the case's reference is)."""
    program, state = single_program(graph, model, dtype)
    if dtype is not None:
        args = cast(args, dtype)
    if fallback is None:
        return _run(program, state, (None,), args)
    with fallback:
        return _run(program, state, (None,), args)


def references(graph: IRGraph, model: torch.nn.Module, args: tuple, dtype: torch.dtype):
    """The single-device runs of ``graph`` (as traced, and the float64 reference) and the bounds of
    :func:`verify.judge.compare.check_tensor` for what that reference did, per tensor dtype
    (:meth:`verify.judge.compare.Float64Fallback.bounds`)."""
    fallback = Float64Fallback(dtype)
    with fallback.draws.recording():  # the float64 reference draws as this run does
        dev = single_device(graph, model, args, None)
    ref = single_device(graph, model, args, torch.float64, fallback)
    return dev, ref, fallback.bounds


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


def _layouts(op, par: Recorder) -> str:
    """What ``op`` reads, each in the layout it reads it and how it got there, and what it writes."""
    reads = []
    for u in reads_by(par, op.name):
        conv = chain_of(par, u.chain)
        info = dict(conv.info) if conv is not None else {}
        how = f"from {info['from']}: {info['steps']}" if info and info.get("steps") != "none" else "as held"
        reads.append(f"{u.tensor} {u.layout} ({how})")
    writes = [f"{r.tensor} {r.layout}" for r in par.records if r.kind == "out" and r.op == op.name]
    return f"reads {', '.join(reads) or 'nothing'} -> writes {', '.join(writes) or 'nothing'}"


def _conversion(par: Recorder, chain: str, backward: bool) -> str:
    """One chain of conversion steps in words: the tensor, the layouts, the consumers and the steps."""
    conv = chain_of(par, chain)
    info = dict(conv.info)
    readers = ", ".join(dict.fromkeys(f"{u.op} input {u.index}" for u in reads_of(par, chain))) or "nothing"
    text = (f"{conv.tensor} {info['from']} -> {info['to']} for {readers} (consumer splits {info['split']} per mesh "
            f"axis), steps: {info['steps']}")
    if backward:
        back = {u.grad_layout for u in reads_of(par, chain)}
        text += f"; its gradient comes back {'/'.join(sorted(back))} and must leave {conv.grad_layout}"
        if info.get("synced"):
            text += f" ({info['synced']})"
    return text


def divergence(graph: IRGraph, plan: Plan, trace: Trace, par: Recorder, world_size: int, model_ref: str = "",
               seed: int = 0, dtype: str = "float32", where: str = "") -> Divergence:
    """The :class:`Divergence` of ``trace``'s first entry beyond its bound, for ``plan`` on ``world_size`` ranks."""
    e = trace.first
    r, backward, c = e.record, e.direction == "backward", e.check
    ops = {o.name: o for o in graph.ops}
    conversion = layouts = ""
    if r.kind == "conv" and not backward:  # a parameter, buffer or input as the ranks hold it (its first reader named)
        kind, tensor = "state", r.tensor
        op = ops.get(reads_of(par, r.chain)[0].op)
        layouts = f"{r.tensor} held {r.layout}"
    elif r.kind == "conv" or (r.kind == "use" and not backward):
        kind, tensor = "conversion", r.tensor
        chain = r.chain
        reader = reads_of(par, chain)[0] if r.kind == "conv" else r
        op = ops.get(reader.op)
        conversion = _conversion(par, chain, backward)
    elif r.kind == "out" and backward:
        kind, tensor, op = "accumulation", r.tensor, ops.get(r.op)
    else:
        kind, tensor, op = "operator", r.tensor, ops.get(r.op)
    if op is not None and not layouts:
        layouts = _layouts(op, par)
    if op is None:
        label, overload, source, rerun, op_name = "", "the program's return", "", "", "output"
    else:
        label = plan.partition(op).label if op.known else "replicate (no annotation)"
        name = op.spec.name if op.known else op.overload
        overload = name if name == op.overload else f"{op.overload}, registered as {name}"
        source, op_name = op.source, op.name
        rerun = rerun_command(op, plan, world_size, model_ref, seed, dtype) if kind == "operator" else ""
    index = r.index if r.kind == "use" else None
    return Divergence(op_name, overload, source, label, "backward" if backward else "forward",
                      c.err if math.isfinite(c.err) else float("inf"), c.tol, rerun, where, kind=kind, tensor=tensor,
                      input_index=index, layouts=layouts, conversion=conversion, reason=c.reason)


def localized(graph: IRGraph, plan: Plan, trace: Trace, par: Recorder, world_size: int, model_ref: str = "",
              seed: int = 0, dtype: str = "float32", where: str = "", note: str = IN_STEP_ZERO) -> Localized:
    """:class:`Localized` from one program's comparison (``note`` where nothing diverges)."""
    if trace.first is None:
        return Localized(None, note, trace.profile())
    return Localized(divergence(graph, plan, trace, par, world_size, model_ref, seed, dtype, where), "", trace.profile())


def localize_program(pm: ParallelModule, model: torch.nn.Module, args: tuple, world_size: int, model_ref: str = "",
                     seed: int = 0, dtype: str = "float32", failing: str = "", fresh=None) -> Localized:
    """Run ``pm``'s plan instrumented on ``args`` (every rank of the plan calls this) and compare every
    record with the single-device runs of the same graph. ``model_ref``, ``seed`` and ``dtype`` name
    the traced model for the culprit's rerun command. Where nothing diverges and ``fresh()`` builds
    the model afresh, the note is true to ``failing`` (the row's first failing check): the model
    itself against its traced graph, the buffers it writes that the program does not
    (:mod:`verify.localize.eager`)."""
    graph, plan, mesh = pm.graph, pm.plan, pm.mesh
    program, local = probed_program(graph, plan, mesh, model)
    par = _run(program, local, mesh.groups, args)
    dev, ref, bounds = references(graph, model, args, DTYPES[dtype])
    trace = compare(par, dev, ref, mesh.groups, bounds)
    if trace.first is None and fresh is not None:
        return Localized(None, _unlocalised(pm, model, fresh(), args, failing), trace.profile())
    return localized(graph, plan, trace, par, world_size, model_ref, seed, dtype)


def _unlocalised(pm: ParallelModule, model: torch.nn.Module, eager: torch.nn.Module, args: tuple, failing: str) -> str:
    """The note of a program none of whose tensors diverges (every rank of the plan calls this)."""
    loss, grads, written = eager_step(eager, args)
    unwritten = [n for n in written if n not in program_writes(pm, args, written)] if written else []
    differs = None
    if step_zero_check(failing):  # the check judged the model itself on step 0: does its traced graph?
        program, state = single_program(pm.graph, model)
        with same_draws(0, 0):
            graph_loss = program.forward(state, (None,), *args, probe=Recorder())
        graph_loss.backward()
        graph_grads = {n: state[n].grad for n, _ in model.named_parameters() if n in state}
        differs = graph_differs(loss, grads, graph_loss.detach(), graph_grads, loss.dtype)
    return unlocalised(failing, differs, unwritten, IN_STEP_ZERO)


def localize_model_case(name: str, policy: str, world_size: int, seed: int, groups, gen_dir: str,
                        dtype: str = "float32", plan_seed: int | None = None, failing: str = "") -> Localized:
    """Where model ``name`` under ``policy`` (a built-in name or ``FILE.py:fn``) first diverges, on its
    step-0 batch and initial parameters, in ``dtype`` (every rank of the case calls this, after the
    case mismatched). ``plan_seed``: the seed the plan was made with, where not the model's (the plan
    a checkpoint resumed under); ``failing``: the row's first failing check (the note is true to it)."""
    from verify.cases.model import resolve_policy  # model_case imports the gang's worker, which imports this
    dt = DTYPES[dtype]
    case = build_model(name, seed)
    model = to_dtype(case.model, dt)
    args = cast(case.batch(0), dt)
    plan_seed = seed if plan_seed is None else plan_seed
    config = ComputeConfig(world_size, tp_size=2 if world_size % 2 == 0 else 1, seed=plan_seed)
    pm = compile_case(built_like(name, seed, model, dt), args, resolve_policy(policy), config, groups,
                      Path(gen_dir) / f"localize-{file_tag(name)}-{file_tag(policy)}-w{world_size}-s{plan_seed}",
                      announce=False)
    return localize_program(pm, model, args, world_size, name, seed, dtype, failing,
                            fresh=lambda: built_like(name, seed, model, dt))
