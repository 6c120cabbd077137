"""Every intermediate tensor of a run, recorded, made whole and compared in program order: the
approach of TTrace (Megatron-LM's gradient-match tests adopted it).

An instrumented program (:mod:`nnscaler.codegen.probe`) hands its :class:`Recorder` three kinds of
tensors, each with its layout and the layout of its gradient:

* ``out``: an operator's output;
* ``conv``: a tensor as it enters one chain of conversion steps (its gradient: what comes back
  through that chain alone);
* ``use``: a tensor as an operator reads it, after its chain (its gradient: that one read's).

The parallel run's records are made whole from every rank's piece by their layouts
(:func:`materialise`: ``D`` joined, ``V`` summed, ``R`` the first rank's copy, the others measured
against it) and compared with the same records of the single-device runs, the same traced graph
node names: values in program order, then gradients in the order backward computes them (latest
first). The first one beyond its bound (:func:`verify.judge.compare.check_tensor`, the one tolerance
policy) names the culprit: an operator whose inputs match but whose output does not (or whose output
gradient matches and input gradient does not), or a conversion whose input matches and output does
not (or, backward, whose consumers' gradients match and the gradient it hands back does not).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from nnscaler.dimops.layout import Shard, join_blocks

from verify.judge.compare import Check, check_tensor

PROFILE_POINTS = 800  # a profile longer than this keeps the worst entry of each of this many runs


@dataclass(frozen=True)
class Record:
    """One recorded tensor: ``kind`` out | use | conv, and where it sits in the program."""

    kind: str
    op: str  # out: its producer; use: its reader (or "output"); conv: ""
    tensor: str
    layout: str
    grad_layout: str
    chain: str = ""  # use: the conversion chain it came through; conv: that chain
    index: int = 0  # use: which of its reader's tensors
    info: tuple = ()  # conv: (key, text) pairs probe.conversion was told

    @property
    def key(self) -> tuple:
        if self.kind == "out":
            return ("out", self.tensor)
        if self.kind == "use":
            return ("use", self.op, self.index)
        return ("conv", self.chain)

    @property
    def label(self) -> str:
        """``linear_1`` (an output), ``linear_1>square`` (a read), ``linear_1#11`` (a conversion chain)."""
        return {"out": self.tensor, "use": f"{self.tensor}>{self.op}", "conv": self.chain}[self.kind]


class Recorder:
    """The ``probe`` of an instrumented program: keeps every record's value and, in backward, its gradient."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.values: dict[tuple, torch.Tensor] = {}
        self.grads: dict[tuple, torch.Tensor] = {}

    def _keep(self, rec: Record, value: Any, alias: bool) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        out = value.view_as(value) if alias else value  # an alias: its own node, its own gradient
        self.records.append(rec)
        self.values[rec.key] = value.detach().clone()
        if out.requires_grad:
            out.register_hook(lambda g, k=rec.key: self.grads.__setitem__(k, g.detach().clone()))
        return out

    def __call__(self, op: str, name: str, value: Any, layout: str) -> Any:
        grad = "x".join("R" if q == "V" else q for q in layout.split("x"))
        return self._keep(Record("out", op, name, layout, grad), value, alias=False)

    def conversion(self, chain: str, name: str, value: Any, layout: str, grad_layout: str, info: dict) -> Any:
        return self._keep(Record("conv", "", name, layout, grad_layout, chain, info=tuple(info.items())), value, True)

    def use(self, op: str, k: int, name: str, value: Any, layout: str, grad_layout: str, chain: str) -> Any:
        return self._keep(Record("use", op, name, layout, grad_layout, chain, k), value, alias=True)

    def output(self, name: str, grad: bool = False) -> torch.Tensor | None:
        """An operator output's value (or gradient) by tensor name."""
        return (self.grads if grad else self.values).get(("out", name))

    def has_output(self, name: str) -> bool:
        return ("out", name) in self.values


@dataclass
class Whole:
    """A record made whole: the tensor, how far the ranks holding copies of it disagree, and why it
    could not be made (missing on some ranks)."""

    tensor: torch.Tensor | None
    spread: float = 0.0
    note: str = ""


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if not (a.is_floating_point() or a.is_complex()):
        return 0.0 if torch.equal(a, b) else float("inf")
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _join(parts: list[torch.Tensor], place: str, spread: float) -> tuple[torch.Tensor, float]:
    if place.startswith("D"):
        q = Shard.parse(place)
        return join_blocks(parts, q.dim, q.blocks, q.balanced), spread
    if place == "V":
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return total, spread
    return parts[0], max([spread] + [_diff(p, parts[0]) for p in parts[1:]])


def materialise(pieces: dict[tuple, torch.Tensor], layouts: dict[tuple, str], groups) -> dict[tuple, Whole]:
    """Every record's whole tensor from this rank's ``pieces`` (``layouts``: the layout of each key;
    ``groups``: this rank's group per mesh axis, ``None`` for an axis of one rank). Axes are joined
    highest first (the nesting convention of :mod:`nnscaler.comm.conversion`), one ``all_gather_object``
    per axis; every rank of the mesh calls this and gets the same answer."""
    held: dict[tuple, Whole] = {k: Whole(x) for k, x in pieces.items()}
    naxes = max((len(lay.split("x")) for lay in layouts.values()), default=0)
    for axis in reversed(range(naxes)):
        group = groups[axis] if axis < len(groups) else None
        if group is None:
            continue
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, {k: w.tensor for k, w in held.items() if w.tensor is not None}, group=group)
        keys = dict.fromkeys(k for part in everyone for k in part)
        keys.update(dict.fromkeys(held))
        for k in keys:
            old = held.get(k, Whole(None))
            parts = [part.get(k) for part in everyone]
            if any(p is None for p in parts):
                missing = sum(p is None for p in parts)
                note = old.note or (f"missing on {missing} of {len(parts)} ranks of mesh axis {axis}"
                                    if missing < len(parts) else "")
                held[k] = Whole(None, old.spread, note)
                continue
            place = layouts[k].split("x")[axis]
            try:
                tensor, spread = _join(parts, place, old.spread)
                held[k] = Whole(tensor, spread, old.note)
            except RuntimeError as exc:  # pieces that do not fit their layout: say so, compare nothing
                held[k] = Whole(None, old.spread, f"pieces do not join as {layouts[k]}: {exc}")
    return held


@dataclass
class Entry:
    """One compared tensor: the record, forward (its value) or backward (its gradient), the verdict."""

    record: Record
    direction: str
    check: Check


def _with_spread(c: Check, whole: Whole) -> Check:
    """A check that also fails where ranks holding copies of a replicated tensor disagree beyond its bound."""
    if whole.note and c.ok:
        return Check(c.name, float("inf"), c.tol, False, whole.note)
    if c.ok and whole.spread > c.tol:
        return Check(c.name, whole.spread, c.tol, False, f"ranks holding copies differ by {whole.spread:.3g} "
                     f"> tolerance {c.tol:.3g}")
    return c


def _dtype(x) -> torch.dtype | None:
    return x.dtype if isinstance(x, torch.Tensor) else None


def _sum(xs: list) -> torch.Tensor | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    total = xs[0].clone()
    for x in xs[1:]:
        total = total + x
    return total


@dataclass
class Trace:
    """The comparison of one parallel run with its single-device runs, in the order it was made."""

    entries: list[Entry] = field(default_factory=list)

    @property
    def first(self) -> Entry | None:
        return next((e for e in self.entries if not e.check.ok), None)

    def profile(self) -> list[list]:
        """``[label, "F" | "B", err, tol]`` per compared tensor in order (a long one thinned to
        :data:`PROFILE_POINTS` runs, each kept by its worst entry)."""
        rows = [[e.record.label, e.direction[0].upper(), e.check.err, e.check.tol] for e in self.entries]
        if len(rows) <= PROFILE_POINTS:
            return rows
        step = len(rows) / PROFILE_POINTS
        runs = [rows[int(i * step):int((i + 1) * step)] for i in range(PROFILE_POINTS)]
        return [max(r, key=lambda x: x[2] / x[3] if x[3] else (0.0 if x[2] == 0 else float("inf"))) for r in runs if r]


def compare(par: Recorder, dev: Recorder, ref: Recorder, groups, bounds: Callable[[torch.dtype], dict]) -> Trace:
    """Every record of the parallel run ``par`` (every rank of its mesh calls this, ``groups`` its
    groups per mesh axis) against the single-device runs ``dev`` (the dtype under test) and ``ref``
    (float64), bounded by :func:`check_tensor` with ``bounds(dtype)`` of each tensor's dtype
    (:meth:`verify.judge.compare.Float64Fallback.bounds`). A record is compared where the
    reference has the same key for the same tensor; a conversion chain's gradient against the sum
    of its reads' reference gradients."""
    layouts = {r.key: r.layout for r in par.records}
    grad_layouts = {r.key: r.grad_layout for r in par.records}
    values = materialise(par.values, layouts, groups)
    grads = materialise(par.grads, grad_layouts, groups)
    known = {r.key: r.tensor for r in dev.records}
    reads: dict[str, list[Record]] = defaultdict(list)
    for r in par.records:
        if r.kind == "use":
            reads[r.chain].append(r)
    scale = max((float(g.abs().max()) for g in ref.grads.values() if g.is_floating_point() and g.numel()), default=0.0)

    def comparable(r: Record) -> bool:
        if r.kind == "conv":
            return bool(reads[r.chain]) and all(known.get(u.key) == u.tensor for u in reads[r.chain])
        return known.get(r.key) == r.tensor

    def reference(store: dict, r: Record, grad: bool):
        if r.kind != "conv":
            return store.get(r.key)
        if not grad:
            return store.get(reads[r.chain][0].key)
        return _sum([store.get(u.key) for u in reads[r.chain]])

    trace = Trace()
    for r in par.records:
        if comparable(r):
            w = values.get(r.key, Whole(None))
            want = reference(dev.values, r, False)
            c = check_tensor(r.label, w.tensor, want, reference(ref.values, r, False), **bounds(_dtype(want)))
            trace.entries.append(Entry(r, "forward", _with_spread(c, w)))
    for r in reversed(par.records):
        if comparable(r):
            w = grads.get(r.key, Whole(None))
            want = reference(dev.grads, r, True)
            c = check_tensor(r.label, w.tensor, want, reference(ref.grads, r, True), scale=scale, **bounds(_dtype(want)))
            trace.entries.append(Entry(r, "backward", _with_spread(c, w)))
    return trace


def reads_of(par: Recorder, chain: str) -> list[Record]:
    """The reads (``use`` records) a conversion chain feeds."""
    return [r for r in par.records if r.kind == "use" and r.chain == chain]


def reads_by(par: Recorder, op: str) -> list[Record]:
    """The reads (``use`` records) of operator ``op``, in argument order."""
    return [r for r in par.records if r.kind == "use" and r.op == op]


def chain_of(par: Recorder, chain: str) -> Record | None:
    return next((r for r in par.records if r.kind == "conv" and r.chain == chain), None)
