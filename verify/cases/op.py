"""What one rank does for one case: the single-device reference, and the partitioned program.

The partitioned program is nnscaler's own (:func:`nnscaler.runtime.partitioned.run_partitioned`):
inputs laid out per the partition, the op on local shards, collectives back to whole outputs, and
backward through those collectives with a random cotangent per output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nnscaler.dimops.partition import Partition, check_partition, enumerate_partitions
from nnscaler.ir.graph import IROp
from nnscaler.ir.plan import Plan
from nnscaler.ops.spec import outputs_of, resolve
from nnscaler.runtime.mesh import RankMesh
from nnscaler.runtime.partitioned import run_partitioned
from verify.cases.draws import same_draws

from verify.judge.compare import Check, check_tensor
from verify.judge.draw_record import DrawRecord
from verify.cases.samples import Sample



def _leaves(sample: Sample, device, dtype: torch.dtype | None = None) -> list[Any]:
    out = []
    for x in sample.inputs:
        if isinstance(x, torch.Tensor):
            x = x.detach().to(device)
            if x.is_floating_point() or x.is_complex():
                wide = torch.complex128 if x.is_complex() else dtype
                x = (x if dtype is None else x.to(wide)).requires_grad_(sample.spec.differentiable)
        out.append(x)
    return out


def _backward(outs: tuple, cots: list, leaves: list) -> list[torch.Tensor | None]:
    pairs = [(y, c) for y, c in zip(outs, cots) if c is not None and isinstance(y, torch.Tensor) and y.requires_grad]
    wanted = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
    if pairs and wanted:
        torch.autograd.backward([y for y, _ in pairs], [c.to(device=y.device, dtype=y.dtype) for y, c in pairs])
    return [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in leaves]


@dataclass
class Reference:
    """Single-device outputs and input gradients, in the dtype under test and in float64."""

    outs: tuple
    outs64: tuple
    grads: list
    grads64: list
    random: str = ""  # why the op cannot be verified element by element (it draws random numbers)


def _same(a: tuple, b: tuple) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, (list, tuple)):  # an opaque '?' output holding tensors
            if not (isinstance(y, (list, tuple)) and _same(tuple(x), tuple(y))):
                return False
        elif isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x.isnan(), y.isnan())
                    and torch.equal(x.nan_to_num(), y.nan_to_num())):
                return False
        elif x != y:
            return False
    return True


def draws_random(sample: Sample, device) -> str:
    """Non-empty (the reason) when the op's outputs depend on the global random stream (two runs
    under different seeds differ) and it has no partition-aware kernel: a plain op draws other
    numbers on a shard than on the whole input, so no split can be compared with one device (it is
    reported as not verifiable, never a match). A kernel that draws the whole tensor's numbers and
    keeps its slice (``opzoo.kernels.dropout``) is verified like any other: both runs draw
    from one generator state (:func:`verify.cases.draws.same_draws`)."""
    spec = sample.spec
    if spec.local is not None:
        return ""
    kwargs = resolve(dict(spec.kwargs), sample.bound.sizes)
    runs = []
    state = torch.random.get_rng_state()
    try:
        for seed in (1, 2):
            torch.manual_seed(seed)
            with torch.no_grad():
                runs.append(outputs_of(spec.anno, spec.fn(*_leaves(sample, device, torch.float64), **kwargs)))
    finally:
        torch.random.set_rng_state(state)
    if _same(*runs):
        return ""
    return ("not verifiable: the operator draws random numbers (its outputs differ under two seeds), so a "
            "partitioned run cannot be compared with one device; register it where it is deterministic")


def reference(sample: Sample, device) -> Reference:
    """Run the plain operator on one device, in the sample's dtype and in float64.

    Under float64 the one-device run *is* the reference (no wider dtype exists), so it would calibrate
    nothing: the tolerance would shrink to its floor, a few units of the result's magnitude, and a
    correct reordered sum whose terms cancel (a sum of 4096 values near zero) would fail. Its
    rounding is then estimated from the float32 run, scaled by eps(float64) / eps(float32): how
    much the op's result moves under rounding at these inputs (its conditioning), at float64's
    unit. A wrong program's error is of the order of the values, far above either."""
    spec = sample.spec
    kwargs = resolve(dict(spec.kwargs), sample.bound.sizes)
    random = draws_random(sample, device)

    def run(dtype):
        leaves = _leaves(sample, device, dtype)
        with same_draws(0, 0):
            outs = outputs_of(spec.anno, spec.fn(*leaves, **kwargs))
        cots = [None if c is None else c.to(device) for c in sample.cotangents]
        grads = _backward(outs, cots, leaves)
        return tuple(y.detach() if isinstance(y, torch.Tensor) else y for y in outs), grads

    # a partition-aware kernel that draws (``rand_like``, ``uniform``, ``exponential``) draws other numbers in
    # float64 than in float32 from one generator state: the float64 reference redraws as the run did, or
    # its distance from the run (the bound) grows to the size of the noise (verify/judge/draw_record.py)
    record = DrawRecord()
    with record.recording():
        outs, grads = run(None)
    with record.replaying():
        outs64, grads64 = run(torch.float64)
    if record.problems:
        random = random or "not verifiable: " + "; ".join(record.problems[:3])
    drew = bool(record.draws)
    if not random and not drew and _float64_under_test(sample):  # a float32 run of a draw draws other numbers
        try:
            outs32, grads32 = run(torch.float32)
        except Exception:  # noqa: BLE001  (an op that runs in float64 only keeps the plain floor)
            pass
        else:
            outs = tuple(_rounding_at_float64(d, w, r) for d, w, r in zip(outs, outs32, outs64))
            grads = [_rounding_at_float64(d, w, r) for d, w, r in zip(grads, grads32, grads64)]
    return Reference(outs, outs64, grads, grads64, random)


def _float64_under_test(sample: Sample) -> bool:
    floats = [x for x in sample.inputs if isinstance(x, torch.Tensor) and x.is_floating_point()]
    return bool(floats) and all(x.dtype == torch.float64 for x in floats)


def _rounding_at_float64(dev, dev32, ref):
    """``ref`` moved by ``dev32``'s rounding error scaled to float64's unit (see :func:`reference`);
    ``dev`` itself where the two are not comparable float tensors."""
    if not (isinstance(dev, torch.Tensor) and isinstance(dev32, torch.Tensor) and isinstance(ref, torch.Tensor)
            and dev.dtype == torch.float64 and dev32.shape == ref.shape and dev32.is_floating_point()):
        return dev
    ratio = torch.finfo(torch.float64).eps / torch.finfo(torch.float32).eps
    moved = ref + (dev32.to(torch.float64) - ref) * ratio
    return torch.where(torch.isfinite(moved), moved, dev)


def partitions_of(sample: Sample, world_size: int, only: str | None = None) -> list[Partition]:
    """Every partition of the sample's op on ``world_size`` ranks, or just ``only`` (validated)."""
    if only is not None:
        p = Partition.parse(only, world_size)
        check_partition(sample.bound, p)
        return [p]
    return list(enumerate_partitions(sample.bound, world_size))


def run_case(sample: Sample, ref: Reference, partition: Partition, mesh: RankMesh, device) -> list[Check]:
    """Run the partitioned op on this rank and judge every output and input gradient."""
    spec = sample.spec
    tol = spec.tolerance
    opts = {k: v for k, v in (("factor", tol and tol.factor), ("floor_eps", tol and tol.floor_eps)) if v is not None}
    leaves = _leaves(sample, device)
    scales: list = []  # per output: the partials' magnitude before a value-split sum (its rounding scales with it)
    with same_draws(0, 0):
        outs = run_partitioned(spec, sample.bound, partition, mesh, leaves, scales)
    cots = [None if c is None else c.to(device) for c in sample.cotangents]
    grads = _backward(outs, cots, leaves)
    checks = []
    for i, (y, d, r, s) in enumerate(zip(outs, ref.outs, ref.outs64, scales)):
        checks.append(_check_output(f"output {i}", _detach(y), d, r, opts if s is None else {**opts, "partials": s}))
    for i, (g, d, r) in enumerate(zip(grads, ref.grads, ref.grads64)):
        if g is not None or d is not None:
            checks.append(check_tensor(f"grad of input {i}", g, d, r, **opts))
    wanted = spec.differentiable and any(c is not None for c in cots) and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in leaves)
    if wanted and not any(c.name.startswith("grad") for c in checks):  # never a match without gradients
        checks.append(Check("gradients", float("inf"), 0.0, False, "the gradient check could not run: no input got "
                            "a gradient on either side (the op disabled autograd or detached its outputs)"))
    return checks


def _check_output(name: str, par, dev, ref, opts: dict) -> Check:
    """A tensor output, or an opaque (``?``) one compared as a whole: a list or tuple element by
    element (the worst element decides), anything else by equality."""
    if isinstance(dev, (list, tuple)):
        if not isinstance(par, (list, tuple)) or len(par) != len(dev):
            return Check(name, float("inf"), 0.0, False, f"opaque output {_kind(par)} != {_kind(dev)}")
        checks = [_check_output(f"{name}[{j}]", _detach(p), _detach(d), _detach(r), opts)
                  for j, (p, d, r) in enumerate(zip(par, dev, ref))]
        return max(checks, key=lambda c: (not c.ok, c.ratio), default=Check(name, 0.0, 0.0, True))
    return check_tensor(name, par, dev, ref, **opts)


def _kind(x) -> str:
    return f"{type(x).__name__} of {len(x)}" if isinstance(x, (list, tuple)) else type(x).__name__


def _detach(y):
    return y.detach() if isinstance(y, torch.Tensor) else y


def op_partition(plan: Plan, op: IROp) -> Partition:
    p = plan.partition(op)  # the replication axis carries no split, its place does not change a verdict
    return Partition(tuple((i, f) for i, f in p.splits if i is not None), p.world_size, p.blocks)
