"""The operators inside a module of a torch program, for localisation below the module: every ATen operator
a run dispatches, in order, tagged with the module call it ran in (forward) or whose backward it ran
in (backward), with its inputs' placements and a copy of its outputs. DTensor dispatches each operator
of the user's program with DTensor arguments, so a dispatch mode sees the program's own operators, on
the parallel run as on one device; views are left out (they compute nothing), and so are the parallel
run's extra operators (collectives, FSDP's copies) when the two sequences are aligned (:func:`aligned`).

A torch dispatch mode (not a trace): the program runs as written, its hooks and styles included."""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from verify.cases.torchpar.mesh import describe

_SKIP_NAMESPACES = ("_c10d_functional", "c10d", "_c10d_functional_autograd", "_dtensor", "profiler")


@dataclass
class Op:
    """One dispatched operator: its name (``aten.mm.default``), the module call it belongs to (None until
    a backward hook claims it), forward or backward, its inputs' layouts in words, its outputs."""

    name: str
    key: str | None
    phase: str
    inputs: str
    outputs: list = field(default_factory=list)


class OpLog(TorchDispatchMode):
    """Records every operator of a run (:class:`Op`); ``where()`` answers the module call running now
    (the localiser's recorder sets it), and backward operators wait for the module whose gradient hook
    fires after them (:meth:`claim`)."""

    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []
        self.key: str | None = None  # the forward module call running now
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace in _SKIP_NAMESPACES or _views(func):
            return out
        leaves = torch.utils._pytree.tree_leaves(out)
        outs = [_copy(t) for t in leaves if isinstance(t, torch.Tensor)]
        if outs:
            ins = [describe(a) for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            self.ops.append(Op(str(func), self.key if self.phase == "forward" else None, self.phase, ", ".join(ins), outs))
        return out

    def claim(self, key: str) -> None:
        """A module's backward hook fired: the backward operators since the last claim were its own."""
        for op in reversed(self.ops):
            if op.phase != "backward" or op.key is not None:
                break
            op.key = key

    def of(self, key: str, phase: str) -> list[Op]:
        return [op for op in self.ops if op.key == key and op.phase == phase]


def _views(func) -> bool:
    """An operator that only re-reads its input (a view, ``detach``): it computes nothing to blame, and pairing
    on it would pair unrelated tensors."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def _copy(t: torch.Tensor):
    """What is kept of an output: a copy (later in-place writes do not reach it); None for a pending partial
    sum, whose reduction only its own layout may run (a masked embedding's mask is released by it)."""
    if isinstance(t, DTensor) and any(p.is_partial() for p in t.placements):
        return None
    with torch.no_grad():
        return t.detach().clone()


def _sig(op: Op) -> tuple:
    return (op.name,) + tuple(len(o.shape) if o is not None else -1 for o in op.outputs)


def aligned(par: list[Op], dev: list[Op]) -> list[tuple[Op, Op]]:
    """The operators both runs dispatched, paired in order by name and their outputs' ranks (the parallel run's
    own extras, and the single-device run's where the parallel program computes otherwise, left out). The
    pairing reads no value or size that differs between ranks, so every rank pairs alike."""
    sm = difflib.SequenceMatcher(a=[_sig(o) for o in par], b=[_sig(o) for o in dev], autojunk=False)
    return [(par[i + k], dev[j + k]) for i, j, n in sm.get_matching_blocks() for k in range(n)]


def fits(p: Op, d: Op) -> bool:
    """Whether ``p``'s outputs can be the parallel run's of ``d``'s: a DTensor of the same global shape, or a plain
    tensor of the same rank no larger along any dimension (this rank's piece of it, or all of it)."""
    for a, b in zip(p.outputs, d.outputs):
        if a is None or b is None:
            continue
        if isinstance(a, DTensor):
            if tuple(a.shape) != tuple(b.shape):
                return False
        elif a.dim() != b.dim() or any(x > y for x, y in zip(a.shape, b.shape)):
            return False
    return True
