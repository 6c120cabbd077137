"""The single-device side of a kink explanation (:mod:`verify.judge.kinks`): which values of a step
lie within rounding of a kink (:func:`near_kinks`), and what putting each one alone on the kink's other
side does to the loss and every gradient (:func:`flip_contributions`); :func:`rescue` asks for them
only where a step's gradient check failed, on every rank of the case together.

A value is near a kink when its distance to it (the float32 run's, or the float64 run's) is within
:data:`KINK_FACTOR` times its row's rounding error (the two runs' distances apart, largest over the last
dimension): a correct program that rounds elsewhere may land it on either side. At most
:data:`MAX_FLIPS` of them, nearest first, are tried: a step has a handful (a width-8192 ReLU FFN over 32
tokens, about 3 per layer), each costs one forward and backward of the single-device model, and only a
failing step pays."""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from nnscaler.recipe import Recipe

from verify.cases.batch import cast
from verify.cases.recipe_steps import apply_steps
from verify.judge.compare import Check
from verify.judge.kinks import explain

KINK_FACTOR = 4  # near a kink: within this many times the row's rounding error of it
MAX_FLIPS = 24  # near-kink values tried per failing step, nearest first

_ONE = {F.relu: (0.0,), torch.relu: (0.0,), torch.Tensor.relu: (0.0,), torch.abs: (0.0,), torch.Tensor.abs: (0.0,),
        F.relu6: (0.0, 6.0), F.hardtanh: None, F.leaky_relu: (0.0,)}  # one-tensor kinks: their points
_CLAMP = {torch.clamp, torch.Tensor.clamp, torch.clip, torch.Tensor.clip, torch.clamp_min, torch.Tensor.clamp_min,
          torch.clamp_max, torch.Tensor.clamp_max}
_PAIR = {torch.maximum: torch.minimum, torch.minimum: torch.maximum, torch.max: torch.min, torch.min: torch.max}
_COMPARE = {torch.gt, torch.lt, torch.ge, torch.le, torch.Tensor.gt, torch.Tensor.lt, torch.Tensor.ge, torch.Tensor.le,
            torch.Tensor.__gt__, torch.Tensor.__lt__, torch.Tensor.__ge__, torch.Tensor.__le__}


def _arg(args, kwargs, i: int, name: str, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _points(func, args, kwargs) -> tuple | None:
    """The kink points of a one-tensor kink call (None: not one)."""
    if func in _ONE:
        if func is F.hardtanh:
            return (_arg(args, kwargs, 1, "min_val", -1.0), _arg(args, kwargs, 2, "max_val", 1.0))
        return _ONE[func]
    if func in _CLAMP:
        if func in (torch.clamp_min, torch.Tensor.clamp_min):
            pts = (_arg(args, kwargs, 1, "min"),)
        elif func in (torch.clamp_max, torch.Tensor.clamp_max):
            pts = (_arg(args, kwargs, 1, "max"),)
        else:
            pts = (_arg(args, kwargs, 1, "min"), _arg(args, kwargs, 2, "max"))
        pts = tuple(p for p in pts if p is not None)
        return pts if pts and all(isinstance(p, (int, float)) for p in pts) else None
    return None


def _off_kink(func, at: float, tiny: float, dtype, args, kwargs) -> float:
    """The step off a value exactly on a kink to the side whose derivative differs from the kink point's own: above
    where both do (relu's is 0 there: above; clamp(min=)'s passes the gradient there: below)."""
    def slope(v: float) -> float:
        t = torch.tensor(v, dtype=dtype, requires_grad=True)
        with torch.enable_grad():
            func(t, *args[1:], **kwargs).backward()
        return float(t.grad)
    here = slope(at)
    return tiny if slope(at + tiny) != here or slope(at - tiny) == here else -tiny


def _distance(func, args, kwargs) -> tuple[str, torch.Tensor] | None:
    """``(kind, signed distance to the nearest kink)`` of a kink call on floating tensors; None otherwise."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return None
    pts = _points(func, args, kwargs)
    if pts is not None:
        x = x.detach()
        d = torch.stack([x - p for p in pts]) if len(pts) > 1 else (x - pts[0])[None]
        return "one", d.gather(0, d.abs().argmin(0, keepdim=True))[0]
    y = _arg(args, kwargs, 1, "other")
    if func in _PAIR and isinstance(y, torch.Tensor) and y.is_floating_point() and y.shape == x.shape:
        return "pair", (x - y).detach()
    if func in _COMPARE and isinstance(y, (int, float, torch.Tensor)):
        return "compare", (x - y).detach() if isinstance(y, (int, float)) or y.is_floating_point() else None
    return None


def _kink_call(func) -> bool:
    return func in _ONE or func in _CLAMP or func in _PAIR or func in _COMPARE


class KinkRecord(TorchFunctionMode):
    """Within: the signed distance to its kink of every element of every kink call, in call order
    (:attr:`distances`; None for a call on non-floating tensors)."""

    def __init__(self):
        super().__init__()
        self.distances: list[torch.Tensor | None] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _kink_call(func):
            got = _distance(func, args, kwargs)
            self.distances.append(None if got is None or got[1] is None else got[1].clone())
        return func(*args, **kwargs)


class KinkFlip(TorchFunctionMode):
    """Within: the kink call number ``call`` puts its element ``index`` (flat) on the kink's other side,
    straight through (the value moves by twice its distance to the kink, a rounding; the backward and
    any mask follow the other side); every other call and element is left as it is. ``flipped`` says
    whether it happened."""

    def __init__(self, call: int, index: int):
        super().__init__()
        self.call, self.index, self.seen, self.flipped = call, index, 0, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _kink_call(func):
            return func(*args, **kwargs)
        n, self.seen = self.seen, self.seen + 1
        got = _distance(func, args, kwargs) if n == self.call else None
        if got is None or got[1] is None or self.index >= got[1].numel():
            return func(*args, **kwargs)
        kind, d = got
        mask = torch.zeros(d.numel(), dtype=torch.bool)
        mask[self.index] = True
        mask = mask.reshape(d.shape)
        self.flipped = True
        if kind == "one":  # mirror across the kink; a value exactly on it goes to a side whose slope differs
            x = args[0]
            tiny = torch.finfo(x.dtype).eps * max(float(x.detach().abs().max()), 1.0)
            on = float(x.detach().flatten()[self.index])
            step = _off_kink(func, on, tiny, x.dtype, args, kwargs) if float(d.flatten()[self.index]) == 0 else tiny
            other = torch.where(d != 0, x.detach() - 2 * d, x.detach() + step)
            return func(x + (torch.where(mask, other, x.detach()) - x.detach()), *args[1:], **kwargs)
        if kind == "pair":  # the other of the two wins
            return torch.where(mask, _PAIR[func](*args, **kwargs), func(*args, **kwargs))
        out = func(*args, **kwargs)  # a comparison: the other answer
        return torch.where(mask, ~out, out)


_SIDE = {torch.gt: torch.gt, torch.Tensor.gt: torch.gt, torch.Tensor.__gt__: torch.gt, torch.lt: torch.lt,
         torch.Tensor.lt: torch.lt, torch.Tensor.__lt__: torch.lt, torch.ge: torch.ge, torch.Tensor.ge: torch.ge,
         torch.Tensor.__ge__: torch.ge, torch.le: torch.le, torch.Tensor.le: torch.le, torch.Tensor.__le__: torch.le}


class KinkFollow(TorchFunctionMode):
    """Within (the float64 reference's run): each kink call takes the side the recorded run (``record``,
    the single-device run in the dtype under test, :class:`KinkRecord`) took, for the values near the kink
    (within :data:`KINK_FACTOR` times the row's rounding) that landed on the other side: the value moves
    to the recorded run's distance from the kink (a rounding), straight through. The reference is then
    the exact model with those ties decided as the run decided them, so its distance from the run is
    rounding alone and the run's own kink flips never widen a bound (random draws are replayed alike:
    :mod:`verify.judge.draw_record`). ``followed`` counts the values moved."""

    def __init__(self, record: KinkRecord):
        super().__init__()
        self.recorded, self.seen, self.followed = list(record.distances), 0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _kink_call(func):
            return func(*args, **kwargs)
        n, self.seen = self.seen, self.seen + 1
        got = _distance(func, args, kwargs)
        d32 = self.recorded[n] if n < len(self.recorded) else None
        if got is None or got[1] is None or d32 is None or d32.shape != got[1].shape or d32.numel() == 0:
            return func(*args, **kwargs)
        kind, d = got
        d32 = d32.to(d.dtype)
        noise = (d - d32).abs()
        noise = noise.amax(dim=-1, keepdim=True).expand_as(d) if d.dim() else noise
        other = ((d > 0) != (d32 > 0)) | ((d == 0) != (d32 == 0))
        mask = other & (noise > 0) & (d.abs() <= KINK_FACTOR * noise)
        count = int(mask.sum())
        if not count:
            return func(*args, **kwargs)
        self.followed += count
        if kind == "one":
            x = args[0]
            moved = torch.where(mask, x.detach() - d + d32, x.detach())
            return func(x + (moved - x.detach()), *args[1:], **kwargs)
        if kind == "pair":
            return torch.where(mask, _PAIR[func](*args, **kwargs), func(*args, **kwargs))
        out = func(*args, **kwargs)
        return torch.where(mask, _SIDE[func](d32, 0), out)


class KinkSides:
    """One step's kink sides, from the run to its float64 reference: :meth:`record` around the run in the
    dtype under test, :meth:`follow` around the float64 run (which then takes the run's side within
    rounding: :class:`KinkFollow`), counted into ``fallback`` (a :class:`~verify.judge.compare.
    Float64Fallback`: its row note)."""

    def __init__(self, fallback):
        self.fallback, self.sides = fallback, KinkRecord()

    def record(self) -> KinkRecord:
        return self.sides

    @contextlib.contextmanager
    def follow(self):
        mode = KinkFollow(self.sides)
        with mode:
            yield mode
        self.fallback.kinks_followed = max(self.fallback.kinks_followed, mode.followed)


def near_kinks(single: torch.nn.Module, single64: torch.nn.Module, run: Callable, args: tuple, args64: tuple,
               fallback, draws: Callable) -> list[tuple[int, int]]:
    """``(call number, flat index)`` of the values near a kink in ``run(single, args)`` (forward only,
    against ``run(single64, args64)`` under ``fallback``), nearest first (distance over the row's
    rounding), at most :data:`MAX_FLIPS`. A row the two runs round alike (no rounding measured) has none."""
    rec64, rec = KinkRecord(), KinkRecord()
    with torch.no_grad():  # as the step's own runs: the float32 draws recorded, the float64 run replaying them
        with draws(), fallback.draws.recording(), rec:
            run(single, args)
        with fallback, draws(), rec64:
            run(single64, args64)
    found: list[tuple[float, int, int]] = []
    for call, (d, d64) in enumerate(zip(rec.distances, rec64.distances)):
        if d is None or d64 is None or d.shape != d64.shape or d.numel() == 0:
            continue
        d, d64 = d.double(), d64.double()
        noise = (d - d64).abs()
        noise = noise.amax(dim=-1, keepdim=True).expand_as(d) if d.dim() else noise
        near = (noise > 0) & (torch.minimum(d.abs(), d64.abs()) <= KINK_FACTOR * noise)
        for i in near.flatten().nonzero().flatten().tolist():
            found.append((float(torch.minimum(d.abs(), d64.abs()).flatten()[i] / noise.flatten()[i]), call, i))
    return [(call, i) for _, call, i in sorted(found)[:MAX_FLIPS]]


def flip_contributions(single: torch.nn.Module, run: Callable, args: tuple, draws: Callable,
                       flips: list[tuple[int, int]], recipe: Recipe = Recipe()) -> list[dict]:
    """For each flip of ``flips``: the change it alone makes to ``single``'s loss (``"loss"``) and to
    every parameter's gradient (by name; after ``recipe``'s steps as one device does them, clipping and
    the like, ``verify/cases/recipe_steps.py``). ``single``'s gradients
    are put back as they were."""
    params = dict(single.named_parameters())
    saved = {n: p.grad for n, p in params.items()}

    def grads(mode=None) -> dict:
        for p in params.values():
            p.grad = None
        with draws():
            if mode is None:
                loss = run(single, args)
            else:
                with mode:
                    loss = run(single, args)
        loss.backward()
        apply_steps(recipe, params.values())
        return {"loss": loss.detach(), **{n: None if p.grad is None else p.grad.detach().clone() for n, p in params.items()}}

    try:
        plain = grads()
        out = []
        for call, index in flips:
            mode = KinkFlip(call, index)
            got = grads(mode)
            if mode.flipped:
                out.append({n: None if g is None or plain[n] is None else g - plain[n] for n, g in got.items()})
        return out
    finally:
        for n, p in params.items():
            p.grad = saved[n]


def step_flips(single: torch.nn.Module, single64: torch.nn.Module, run: Callable, args: tuple, fallback,
               draws: Callable, recipe: Recipe = Recipe()) -> list[dict]:
    """What each value near a kink of the step would change alone on the kink's other side
    (:func:`near_kinks`, :func:`flip_contributions`), on the reference's rank, at the step's point."""
    flips = near_kinks(single, single64, run, args, cast(args, torch.float64), fallback, draws)
    return flip_contributions(single, run, args, draws, flips, recipe) if flips else []


def explainer(step: int, reference, models: Callable[[], tuple], run: Callable, args: tuple, fallback,
              draws: Callable, recipe: Recipe = Recipe()) -> Callable:
    """``kinks(checks, grads, judge)`` for a step's gradient checks (:func:`rescue`), the flips measured on
    ``run(single, args)`` against ``single64`` (:func:`step_flips`; ``models()`` gives the two, asked on
    ``reference``'s computing rank alone, the only one that holds them)."""
    return partial(rescue, step=step, reference=reference,
                   contributions=lambda: step_flips(*models(), run, args, fallback, draws, recipe))


def any_rank(flag: bool, group) -> bool:
    """Whether ``flag`` holds on any rank of ``group`` (every rank of it calls; None: this rank alone)."""
    if group is None or not dist.is_initialized():
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def rescue(checks: list[Check], grads: dict, judge: Callable[[str, torch.Tensor | None], Check], step: int,
           reference, contributions: Callable[[], list[dict]]) -> list[Check]:
    """``checks`` (the step's gradient checks, one per name of ``grads``, the parallel gradients, in
    order), or where one failed on any rank of the case and the near-kink flips of the single-device
    step (``contributions()``, computed on the reference's rank, :class:`~verify.cases.reference.
    SharedReference`) explain it (:func:`verify.judge.kinks.explain`): the checks with those flips'
    contributions taken off, and a note naming how many values took the kink's other side. Every rank
    of the case calls it at the same point."""
    if not any_rank(not all(c.ok for c in checks), reference.group):
        return checks
    found = reference.share(contributions)
    if not found:
        return checks
    chosen, mended = explain(grads, judge, found)
    if not chosen or not all(c.ok for c in mended):
        return checks
    return mended + [Check(
        f"note: kinks step {step}", 0.0, 0.0, True,
        f"{len(chosen)} value(s) within rounding of a kink took the other side in the program; with their exact "
        f"contributions taken off, every gradient of step {step} is within its bound")]
