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

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from verify.cases.batch import cast
from verify.judge.dtypes import to_dtype
from verify.cases.torchpar.names import model_name
from verify.cases.fresh import load_like
from verify.cases.samples import DTYPES
from verify.api import Pipelined
from verify.cases.torchpar.build import parallel_model
from verify.cases.torchpar.ring_cpu import cpu_ring_attention, merges_in_float32
from verify.cases.torchpar.mesh import CP, build_mesh, describe, dp_slice, whole
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

    def __init__(self, root: nn.Module):
        self.names = {m: model_name(n) or "(the model)" for n, m in root.named_modules()}
        self.stack: list[nn.Module] = []
        self.handles = []

    def __enter__(self) -> "ModuleStack":
        for m in self.names:
            self.handles.append(m.register_forward_pre_hook(lambda mod, args: self.stack.append(mod), prepend=True))
            self.handles.append(m.register_forward_hook(lambda mod, args, out: self._pop(mod)))
        return self

    def _pop(self, mod):
        if self.stack and self.stack[-1] is mod:
            self.stack.pop()

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

    def _post(self, mod, args, out):
        # a partial value is left to the style's own reduction (a masked embedding's partial can be
        # reduced once only): it is taken after the style's hook instead
        key = self.pending[mod][-1]
        self.calls[key]["outputs"] = [None if _partial(t) else _keep(t) for t in _tensors(out)]
        self.calls[key]["raw"] = [id(t) for t in _tensors(out)]
        self.order.append(key)

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

    def remove(self):
        for h in self.handles:
            h.remove()


def _run(model: nn.Module, args: tuple, context=None, backward: bool = True, tolerate: bool = False) -> Recorder:
    """One forward (and backward) with hooks; ``tolerate``: an exception ends the run and is kept
    (``rec.raised``, with the module it was raised in) along with the calls that finished before it."""
    rec = Recorder(model, backward)
    try:
        with (context or _null)():
            loss = model(*args)
            if backward:
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


def localize_torchpar(job: dict, groups) -> Divergence | str:
    """Where a failing torch-parallelization case first leaves the single-device model, or a line
    saying why no module was named."""
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
    dev = _run(ref, dp_slice(args, mesh))
    fallback = Float64Fallback(dt)
    with fallback:
        r64 = _run(ref64, cast(local, torch.float64))
    raised = None  # the program's own exception, when it raises: the modules before it are judged
    try:
        p = _run(par.module, local, par.step_context)
    except Exception as exc:  # raised in backward, or full backward hooks refused (a module whose outputs are
        # views, say): forward only, up to where it raises
        p = _run(par.module, local, par.step_context, backward=False, tolerate=True)
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
            return _found(key, c["module"], "forward", outs)
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
            return _found(key, c["module"], "backward", gin, "gradient of its inputs")
        if not gout[0] and entered is None:
            entered = _found(key, c["module"], "backward", gout, "gradient of its output (already wrong when its "
                             "backward starts: the fault lies in backward code between modules, e.g. a custom "
                             "autograd function or hook outside any module)")
    if entered is not None:
        return entered
    if raised is not None:
        return (f"every module that finished before the program raised ({raised}) matches one device on the "
                f"first batch")
    return ("every module's outputs and input gradients match one device on the first batch: the fault lies "
            "after backward (parameter gradients not reduced across ranks, the optimizer step, the checkpoint) "
            "or in a later step")


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
