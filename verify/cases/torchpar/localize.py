"""Module-level localisation of a torch-parallelization case that fails.

* :class:`ModuleStack`: while the parallel module runs, the modules being called; an exception
  escaping its forward is raised again as :class:`ModuleError` naming the innermost module and its
  parameters' placements (DTensor refuses a mis-declared layout with a shape error: this says where).
* :func:`localize_torchpar`: one forward and backward of the first step's batch at the initial
  parameters, with hooks on every module of the parallel model and of the single-device model (in
  the dtype under test and in float64). Each module's inputs and outputs (forward), and its output
  and input gradients (backward), are materialised whole (:func:`~verify.cases.torchpar.mesh.whole`:
  ``full_tensor()`` of a DTensor, a style's local piece gathered) and judged by
  :func:`~verify.judge.compare.check_tensor`. The culprit is the first module (in the order calls
  finish) whose inputs match and whose output does not; when every output matches, the first module
  (in backward order) whose output gradients match and whose input gradients do not. A program that
  raises is judged up to where it raised: a module whose output was laid out wrong (its global shape
  not one device's) is named even when the exception surfaces modules later, or in backward.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from verify.cases.batch import cast
from verify.judge.dtypes import to_dtype
from verify.cases.torchpar.names import model_name
from verify.cases.torchpar.op_log import OpLog, aligned, fits
from verify.cases.fresh import load_like
from verify.cases.samples import DTYPES
from verify.api import Pipelined
from verify.cases.torchpar.build import parallel_model
from verify.cases.torchpar.ring_cpu import cpu_ring_attention, merges_in_float32
from verify.cases.torchpar.gang_mesh import gang_groups
from verify.cases.torchpar.mesh import CP, batch_rows, build_mesh, data_slices, describe, dp_slice, whole
from verify.judge.compare import Float64Fallback, check_tensor
from verify.judge.verdict import Divergence
from verify.models.loader import build_model


class ModuleError(RuntimeError):
    """An exception raised inside a module of the parallel model, with that module named."""


def placements(module: nn.Module, most: int = 4) -> str:
    """``weight: S(0) on tp`` for the module's parameters (its own, else its children's, the first
    ``most``); ``plain`` where a parameter is not a DTensor (replicated by hand, or left alone)."""
    own = list(module.named_parameters(recurse=False)) or list(module.named_parameters())
    text = "; ".join(f"{n}: {describe(p)}" for n, p in own[:most])
    return (text + (f"; {len(own) - most} more" if len(own) > most else "")) or "no parameters"


class ModuleStack:
    """The modules of ``root`` being called (innermost last); on an exception inside one,
    :class:`ModuleError` names it."""

    def __init__(self, root: nn.Module, crumb=None):
        self.names = {m: model_name(n) or "(the model)" for n, m in root.named_modules()}
        self.stack: list[nn.Module] = []
        self.handles = []
        self.crumb = crumb  # a rank's Breadcrumb (verify/runner/rank_logs.py): the module it is in, if it dies there

    def __enter__(self) -> "ModuleStack":
        for m in self.names:
            self.handles.append(m.register_forward_pre_hook(lambda mod, args: self._push(mod), prepend=True))
            self.handles.append(m.register_forward_hook(lambda mod, args, out: self._pop(mod)))
        return self

    def _push(self, mod):
        self.stack.append(mod)
        self._say()

    def _pop(self, mod):
        if self.stack and self.stack[-1] is mod:
            self.stack.pop()
            self._say()

    def _say(self):
        if self.crumb is not None:
            mod = self.stack[-1] if self.stack else None
            self.crumb.set(f"the forward of module {self.names[mod]} ({type(mod).__name__})" if mod is not None
                           else "the program, between modules")

    def backward(self):
        """Backward starts: module hooks say no more (full backward hooks would change the program)."""
        if self.crumb is not None:
            self.crumb.set("backward")

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False

    @contextmanager
    def naming(self):
        try:
            yield
        except ModuleError:
            raise
        except Exception as exc:
            if not self.stack:
                raise
            mod = self.stack[-1]
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ModuleError(f"in module {self.names[mod]} ({type(mod).__name__}; {placements(mod)}): "
                              f"{type(exc).__name__}: {text}") from exc


def _tensors(x) -> list:
    return [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def _partial(t) -> bool:
    return isinstance(t, DTensor) and any(p.is_partial() for p in t.placements)


def _keep(t):
    """What is kept of a tensor seen by a hook: a DTensor made whole at once (its placements in words),
    a plain tensor as it is (gathered later, when the reference's shape is known)."""
    if t is None:
        return None
    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.full_tensor().detach(), describe(t)
    return t.detach()


class Recorder:
    """Hooks on every module of ``root``: per call (in the order calls finish) its inputs and
    outputs, and (in backward order) its output and input gradients. Collective where the model
    holds DTensors: every rank records the same calls in the same order."""

    def __init__(self, root: nn.Module, backward: bool = True):
        self.names = {m: model_name(n) or "(the model)" for n, m in root.named_modules()}
        self.calls: dict[str, dict] = {}
        self.order: list[str] = []
        self.back: list[str] = []
        self.count: dict[str, int] = {}
        self.pending: dict[nn.Module, list[str]] = {}
        self.raised: str | None = None  # what a tolerant run raised (:func:`_run`)
        self.stack: list[str] = []  # the module calls running now, innermost last
        self.oplog: OpLog | None = None  # the operators of the run, by module call (verify/cases/torchpar/op_log.py)
        self.handles = []
        for m in self.names:
            self.handles.append(m.register_forward_pre_hook(self._pre, prepend=True))  # before a style's input hook
            self.handles.append(m.register_forward_hook(self._post, prepend=True))  # before a style's output hook
            self.handles.append(m.register_forward_hook(self._late))
            if backward:
                self.handles.append(m.register_full_backward_hook(self._grad, prepend=True))

    def _pre(self, mod, args):
        name = self.names[mod]
        k = self.count.get(name, 0)
        self.count[name] = k + 1
        key = name if k == 0 else f"{name}#{k}"
        self.pending.setdefault(mod, []).append(key)
        self.calls[key] = {"inputs": [_keep(t) for t in _tensors(args)], "module": mod}
        self.stack.append(key)
        if self.oplog is not None:
            self.oplog.key = key

    def _post(self, mod, args, out):
        # a partial value is left to the style's own reduction (a masked embedding's partial can be
        # reduced once only): it is taken after the style's hook instead
        key = self.pending[mod][-1]
        self.calls[key]["outputs"] = [None if _partial(t) else _keep(t) for t in _tensors(out)]
        self.calls[key]["raw"] = [id(t) for t in _tensors(out)]
        self.order.append(key)
        if self.stack and self.stack[-1] == key:
            self.stack.pop()
        if self.oplog is not None:
            self.oplog.key = self.stack[-1] if self.stack else None

    def _late(self, mod, args, out):
        call = self.calls[self.pending[mod][-1]]
        late = _tensors(out)
        if len(late) == len(call["outputs"]):  # what the rest of the model is handed: a style's DTensor (its global
            # shape as declared, right or not), or the partial value the style reduced
            call["outputs"] = [_keep(t) if o is None or (isinstance(t, DTensor) and i != id(t) and not _partial(t))
                               else o for o, t, i in zip(call["outputs"], late, call["raw"])]

    def _grad(self, mod, grad_in, grad_out):
        key = self.pending[mod].pop()
        self.calls[key]["grad_out"] = [_keep(g) for g in grad_out]
        self.calls[key]["grad_in"] = [_keep(g) for g in grad_in]
        self.back.append(key)
        if self.oplog is not None:
            self.oplog.claim(key)

    def remove(self):
        for h in self.handles:
            h.remove()


def _run(model: nn.Module, args: tuple, context=None, backward: bool = True, tolerate: bool = False,
         oplog: OpLog | None = None) -> Recorder:
    """One forward (and backward) with hooks; ``tolerate``: an exception ends the run and is kept
    (``rec.raised``, with the module it was raised in) along with the calls that finished before it;
    ``oplog``: every operator of the run recorded too, by module call."""
    rec = Recorder(model, backward)
    rec.oplog = oplog
    try:
        with (context or _null)(), (oplog if oplog is not None else _null()):
            loss = model(*args)
            if backward:
                if oplog is not None:
                    oplog.phase = "backward"
                loss.backward()
    except Exception as exc:
        if not tolerate:
            raise
        inside = [k for k in rec.calls if k not in rec.order]  # calls entered, never finished: innermost last
        rec.raised = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}" + (
            f" in module {inside[-1]}" if inside else "")
    finally:
        rec.remove()
    return rec


@contextmanager
def _null():
    yield


def _judge(par: list, dev: list, ref: list, mesh, kw: dict, group) -> tuple[bool, float, float, str]:
    """Every tensor of one side of a call: (all match on every rank, worst err, its tol, layout of the
    worst). Collective over ``group`` (the case's ranks): the ranks agree on the verdict, so they
    stop at the same call."""
    ok, worst = _judge_here(par, dev, ref, mesh, kw)
    flag = torch.tensor([1.0 if ok else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item()), *worst


def _judge_here(par: list, dev: list, ref: list, mesh, kw: dict) -> tuple[bool, tuple]:
    ok, worst = True, (0.0, 0.0, "")
    for p, d, r in zip(par, dev, ref):
        if isinstance(d, tuple) or isinstance(r, tuple) or d is None or r is None:
            continue
        if p is None:
            whole_p, how = None, "missing"
        elif isinstance(p, tuple):  # a DTensor, made whole when it was recorded
            whole_p, how = p
        else:
            whole_p, how = whole(p, tuple(d.shape), mesh)
        if whole_p is None:
            ok, worst = False, (float("inf"), 0.0, how)
            continue
        if tuple(whole_p.shape) != tuple(d.shape):  # laid out wrong: its global shape is not one device's
            how = f"{how}, global shape {tuple(whole_p.shape)} where one device's is {tuple(d.shape)}"
        c = check_tensor("", whole_p.to(d.dtype), d, r, **kw)
        if not c.ok and (ok or c.err > worst[0]):
            ok, worst = False, (c.err, c.tol, how)
    return ok, worst


def localize_torchpar(job: dict, groups, first_failure: str = "") -> Divergence | str:
    """Where a failing torch-parallelization case first leaves the single-device model, or a line
    saying why no module was named (where its first failing check, ``first_failure``, is a loss and
    every module matches, whether the loss is normalised per rank; meshes the program lays itself take the
    gang's groups)."""
    with gang_groups(groups):
        return _localize(job, groups, first_failure)


def _localize(job: dict, groups, first_failure: str) -> Divergence | str:
    dt = DTYPES[job.get("dtype", "float32")]
    names, sizes = tuple(n for n, _ in job["mesh"]), tuple(s for _, s in job["mesh"])
    mesh = build_mesh(names, sizes, groups)
    if dict(zip(names, sizes)).get(CP, 1) > 1:
        return _context_parallel(job, mesh, dt)
    par, (case, ref) = parallel_model(job["model"], job["parallelize"], job["seed"], dt, mesh)
    if isinstance(par, Pipelined):
        return ("pipeline: modules are not compared across stages (the row's stage layout check says which stage "
                "holds which modules)")
    ref64 = load_like(to_dtype(build_model(job["model"], job["seed"]).model, torch.float64), ref)
    args = cast(case.batch(0), dt)
    local = dp_slice(args, mesh)
    logs = {side: OpLog() for side in ("dev", "r64")}
    dev = _run(ref, dp_slice(args, mesh), oplog=logs["dev"])
    fallback = Float64Fallback(dt)
    with fallback:
        r64 = _run(ref64, cast(local, torch.float64), oplog=logs["r64"])
    raised = None  # the program's own exception, when it raises: the modules before it are judged
    try:
        logs["par"] = OpLog()
        p = _run(par.module, local, par.step_context, oplog=logs["par"])
    except Exception as exc:  # raised in backward, or full backward hooks refused (a module whose outputs are
        # views, say): forward only, up to where it raises
        logs["par"] = OpLog()
        p = _run(par.module, local, par.step_context, backward=False, tolerate=True, oplog=logs["par"])
        raised = p.raised or f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}" \
            " in backward"
    kw = fallback.bounds()
    group = groups.get(range(job["world_size"]))
    common = [k for k in p.order if k in dev.calls and k in r64.calls]
    entered = None  # the first call whose inputs already differ (a fault between modules, if no culprit)
    for key in common:  # forward: the first call whose inputs match and outputs do not
        c, d, r = p.calls[key], dev.calls[key], r64.calls[key]
        ins = _judge(c["inputs"], d["inputs"], r["inputs"], mesh, kw, group)
        outs = _judge(c["outputs"], d["outputs"], r["outputs"], mesh, kw, group)
        if ins[0] and not outs[0]:
            return _with_operator(_found(key, c["module"], "forward", outs), key, "forward", logs, mesh, kw, group)
        if not ins[0] and entered is None:
            entered = _found(key, c["module"], "forward", ins, "input (already wrong when it is called: the fault "
                             "lies in code between modules, a hook or the caller's own)")
    if entered is not None:
        return entered
    for key in [k for k in p.back if k in dev.calls and k in r64.calls and "grad_in" in dev.calls[k]]:
        c, d, r = p.calls[key], dev.calls[key], r64.calls[key]
        gout = _judge(c["grad_out"], d["grad_out"], r["grad_out"], mesh, kw, group)
        gin = _judge(c["grad_in"], d["grad_in"], r["grad_in"], mesh, kw, group)
        if gout[0] and not gin[0]:
            return _with_operator(_found(key, c["module"], "backward", gin, "gradient of its inputs"), key, "backward",
                                  logs, mesh, kw, group)
        if not gout[0] and entered is None:
            entered = _found(key, c["module"], "backward", gout, "gradient of its output (already wrong when its "
                             "backward starts: the fault lies in backward code between modules, e.g. a custom "
                             "autograd function or hook outside any module)")
    if entered is not None:
        return entered
    if raised is not None:
        return (f"every module that finished before the program raised ({raised}) matches one device on the "
                f"first batch")
    per_rank = _per_rank_normalisation(ref64, args, mesh, first_failure)
    if per_rank is not None:
        return per_rank
    return ("every module's outputs and input gradients match one device on the first batch: the fault lies "
            "after backward (parameter gradients not reduced across ranks, the optimizer step, the checkpoint) "
            "or in a later step")


def _with_operator(found: Divergence, key: str, phase: str, logs: dict, mesh, kw: dict, group) -> Divergence:
    """``found`` (a module) with the first operator inside it whose output leaves one device (forward: the
    operators of its call; backward: those that ran between its children's gradient hooks and its own),
    with its inputs' and output's layouts and its error; or a line saying every operator inside matches.
    Collective over ``group``: the operators are paired by name, alike on every rank."""
    mine, ones, ref = logs["par"].of(key, phase), logs["dev"].of(key, phase), logs["r64"].of(key, phase)
    to64 = {id(d): r for d, r in aligned(ones, ref)}
    pairs = [(p, d, to64[id(d)]) for p, d in aligned(mine, ones) if id(d) in to64]
    fit = torch.tensor([1.0 if fits(p, d) else 0.0 for p, d, _ in pairs])
    if len(pairs):  # a pair every rank's piece fits, or none: the ranks compare the same operators
        dist.all_reduce(fit, op=dist.ReduceOp.MIN, group=group)
    pairs = [pdr for pdr, f in zip(pairs, fit.tolist()) if f]
    for n, (p, d, r) in enumerate(pairs):
        ok, err, tol, how = _judge([_keep(t) for t in p.outputs], d.outputs, r.outputs, mesh, kw, group)
        if not ok:
            local = not any(isinstance(t, DTensor) for t in p.outputs)
            text = (f"inside it, the first divergent operator of its {phase}: {p.name} (operator {n + 1} of the "
                    f"{len(pairs)} both runs dispatch there; inputs: {p.inputs or 'none'}; output: {how}), error "
                    f"{err:.3g} > tolerance {tol:.3g}" + ("; a local tensor: if the program means it as a partial "
                                                          "value (summed over ranks later), the fault lies after it"
                                                          if local else ""))
            break
    else:
        paired = {id(p) for p, _, _ in pairs}
        extra = Counter(p.name for p in mine if id(p) not in paired)
        text = "; ".join(
            ([f"each of the {len(pairs)} operators of its {phase} that both runs dispatch matches one device"]
             if pairs else []) +
            ([f"operators of its {phase} only the parallel program runs: "
              + ", ".join(f"{n}" + (f" x{c}" if c > 1 else "") for n, c in extra.items())] if extra else []))
        if text:
            text += (": the fault lies in those, or in the program's own collectives, hooks and declared layouts"
                     if extra else ": the fault lies in the program's own collectives, hooks and declared layouts")
    return dataclasses.replace(found, layouts=text) if text else found


def _per_rank_normalisation(ref64: nn.Module, args: tuple, mesh, first_failure: str) -> str | None:
    """Why the step's loss is wrong (``first_failure`` is a loss) when every module is right: one device's loss
    on each ``dp`` rank's rows, averaged over the ranks (what the ranks compute, since each matches one device
    on its rows), is not its loss on the whole batch. None where it is (to float64 rounding), without data axes,
    or when the first failure is not the loss."""
    n = data_slices(mesh)[0]
    if not first_failure.startswith("loss") or n < 2:
        return None
    a64 = cast(args, torch.float64)
    with torch.no_grad():
        whole_loss = float(ref64(*a64))
        mean = sum(float(ref64(*batch_rows(a64, n, i))) for i in range(n)) / n
    if abs(mean - whole_loss) <= 1e-9 * max(1.0, abs(whole_loss)):
        return None
    return (f"every module matches one device on this rank's rows, and so does this rank's loss, but the mean over "
            f"the {n} data-parallel ranks of one device's loss on each rank's rows ({mean:.6g}) is not its loss on the whole "
            f"batch ({whole_loss:.6g}): the loss is normalised per rank (a mean over each rank's own rows or tokens, "
            f"as with ignored labels spread unevenly); divide by the count over the whole batch (all-reduced over "
            f"dp first, as torchtitan's global-token normalisation does): the gradient sync is not at fault")


def _context_parallel(job: dict, mesh, dt: torch.dtype) -> str:
    """Why modules are not compared under cp; in a float64 run, whether the user's ring (``fn`` applied
    as the case did) merges in float32."""
    why = ("context parallelism: modules are not compared (each rank's activations are sequence chunks in the "
           "load balancer's order); the row's first failing check names the first wrong tensor")
    if dt == torch.float64:
        with cpu_ring_attention():  # torch's CP options as fn leaves them, restored after
            parallel_model(job["model"], job["parallelize"], job["seed"], dt, mesh)
            if merges_in_float32():
                why += ("; torch's ring attention merges its blocks in float32 (_cp_options.convert_to_f32, on by "
                        "default): a float64 run of it is no float64 program")
    return why


def _found(key: str, module: nn.Module, direction: str, judged, tensor: str = "") -> Divergence:
    _, err, tol, how = judged
    return Divergence(op=key, overload=type(module).__name__, source="", direction=direction, err=err, tol=tol,
                      partition=f"{placements(module)}; the diverging tensor: {how}", what="module", tensor=tensor)
