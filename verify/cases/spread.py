"""More samples of a bf16 recipe's own rounding error, per tensor and step.

The low-precision rule (:mod:`verify.judge.compare`) bounds the parallel program by the single-device
recipe's distance from float64. Where that error is coherent (one early rounding carried into every
term, as in a gradient summed over every token, or every gradient of a step sharing the error of the
logits) one step's distance is one sample of a heavy-tailed quantity: measured on ``resnet_gn`` under
``tp`` (seed 0, step 1), the single-device run landed at 1/3 to 1/7 of its usual error on every
gradient at once while the (correct) parallel program landed at the usual one. Other correct
programs give more samples: the same recipe at a point moved by a random half ulp of bf16 in every
parameter (float64 reference at exactly the same point), so each bf16 rounding is redrawn. The bound
takes the largest sample of the tensor's record, so a step where the first is lucky is not judged by
luck (measured: :mod:`verify.judge.compare`).

A discrete selection (``topk``, ``max``/``argmax`` over a dim: a mixture of experts' routing) is not continuous in its scores: where
a row's k-th and (k+1)-th scores lie within a rounding of each other, a correct program that rounds
elsewhere (a tensor-parallel partial sum, another batch split) may pick the other one, and that
token's contribution moves to another expert: an O(1) change no half-ulp move of the parameters need
reproduce (``mixtral_ep`` under dp at W=2, seed 1: the resumed step's expert gradient 2.2x over its
bound, every step-0 tensor matching). So where the single-device run has such near-ties (a gap
within a few times the row's own rounding error, measured against the float64 run's scores), one
more sample runs it with each of them broken the other way (:class:`TieFlips`): the spread of
correct programs includes the routings its rounding can flip. Steps without near-ties take no such
sample."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from torch.utils._python_dispatch import TorchDispatchMode

from verify.cases.draws import same_draws
from verify.judge.compare import Float64Fallback
from verify.judge.dtypes import convert

PERTURB = 2.0 ** -9  # relative shift of every parameter: half an ulp of bf16
SAMPLES = 2  # moved points per step (one gave a worst correct err/tol of 0.97, two 0.57)
TIE_FACTOR = 4  # a near-tie: k-th and (k+1)-th scores closer than this many times the row's rounding error


def _selection(func, args, kwargs) -> tuple[int, int, bool, bool, str] | None:
    """``(k, dim, largest, keepdim, returns)`` of a discrete selection over a dim (``topk``; ``max``/
    ``min`` over a dim; ``argmax``/``argmin`` over a dim), ``returns`` one of ``"both"`` (values and
    indices) or ``"indices"``; None for any other call."""
    a = lambda i, name, default: args[i] if len(args) > i else kwargs.get(name, default)  # noqa: E731
    if func is torch.ops.aten.topk.default:
        return a(1, "k", 1), a(2, "dim", -1), a(3, "largest", True), True, "both"
    if func in (torch.ops.aten.max.dim, torch.ops.aten.min.dim):
        return 1, a(1, "dim", -1), func is torch.ops.aten.max.dim, a(2, "keepdim", False), "both"
    if func in (torch.ops.aten.argmax.default, torch.ops.aten.argmin.default) and a(1, "dim", None) is not None:
        return 1, a(1, "dim", None), func is torch.ops.aten.argmax.default, a(2, "keepdim", False), "indices"
    return None


class TieFlips(TorchDispatchMode):
    """Within, with ``scores=None``: records the floating input of every discrete selection over a dim
    (``topk``, ``max``/``min``/``argmax``/``argmin`` over a dim: :func:`_selection`; the float64 run's),
    in call order, in ``recorded``. With ``scores`` (those records): every such selection of floating
    scores picks, in each row whose k-th and (k+1)-th best differ by at most :data:`TIE_FACTOR` times
    the row's rounding error (its largest distance from the recorded float64 scores), the (k+1)-th in
    place of the k-th (values gathered from the scores, so the backward follows the flipped choice);
    ``flips`` counts the rows changed. A call whose record is missing or of another shape is left as it is."""

    def __init__(self, scores: list[torch.Tensor] | None = None):
        super().__init__()
        self.scores = None if scores is None else list(scores)
        self.recorded: list[torch.Tensor] = []
        self.flips = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sel = _selection(func, args, kwargs) if args and isinstance(args[0], torch.Tensor) \
            and args[0].is_floating_point() else None
        if sel is None:
            return func(*args, **kwargs)
        x = args[0]
        if self.scores is None:
            self.recorded.append(x.detach().clone())
            return func(*args, **kwargs)
        ref = self.scores.pop(0) if self.scores else None
        k, dim, largest, keepdim, returns = sel
        if ref is None or ref.shape != x.shape or x.dim() == 0 or k == 0 or k >= x.shape[dim]:
            return func(*args, **kwargs)
        values, idx = torch.ops.aten.topk.default(x, k + 1, dim, largest)
        gap = (values.narrow(dim, k - 1, 1) - values.narrow(dim, k, 1)).abs().double()
        noise = (x.double() - ref.double()).abs().amax(dim=dim, keepdim=True)
        near = gap <= TIE_FACTOR * noise
        self.flips += int(near.sum())
        keep = idx.narrow(dim, 0, k).clone()
        last = keep.narrow(dim, k - 1, 1)
        last.copy_(torch.where(near, idx.narrow(dim, k, 1), last))
        picked = x.gather(dim, keep)
        if not keepdim:  # max/min/argmax/argmin over a dim without keepdim (k = 1)
            picked, keep = picked.squeeze(dim), keep.squeeze(dim)
        return keep if returns == "indices" else (picked, keep)


def _rel(x: torch.Tensor | None, ref: torch.Tensor | None) -> float | None:
    if x is None or ref is None:
        return None
    ref = ref.double()
    norm = float(ref.norm())
    return float((x.double() - ref).norm()) / norm if norm > 0 else None


def moved_samples(single: torch.nn.Module, single64: torch.nn.Module, run: Callable, args: tuple, args64: tuple,
                  seed: int, step: int, fallback: Float64Fallback) -> None:
    """Record in ``fallback.spreads`` the relative error of the loss and of every parameter's gradient
    of the recipe's single-device model ``single`` at :data:`SAMPLES` points, each parameter moved by
    :data:`PERTURB` at random, against ``single64`` (the float64 reference) at each point; ``run(model, args)`` computes the step's loss
    as the case does. Each sample runs the models themselves (never a copy: a user's model may hold what
    ``copy.deepcopy`` cannot take, a ``torch.library`` op handle, a lock), whose parameters, gradients and
    buffers are put back as they were after it."""
    for k in [*range(SAMPLES), None]:  # None: the near-ties flipped (module docstring)
        with _put_back(single), _put_back(single64):
            sample = _sample(single, single64, run, args, args64, seed, step, k, fallback)
        for key, rel in sample.items():
            if rel is not None:
                fallback.spreads.add(key, rel)


@contextlib.contextmanager
def _put_back(model: torch.nn.Module):
    """Within: ``model`` may be moved, run and differentiated; on exit its parameters, their gradients
    and its buffers (non-persistent ones too) hold what they held on entry."""
    params = [(p, p.detach().clone(), p.grad) for p in model.parameters()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for p, value, grad in params:
                p.copy_(value)
                p.grad = grad
            for b, value in buffers:
                b.copy_(value)


def _sample(single, single64, run, args, args64, seed: int, step: int, k: int | None,
            fallback: Float64Fallback) -> dict[str, float | None]:
    """The relative errors of sample ``k`` (``"loss"``, ``"grad <name>"``); ``k=None``: at the point
    itself with its near-ties flipped ({} where it has none)."""
    if k is None and fallback.spreads.selects is False:
        return {}  # no selection in this model (found on its first step): nothing to flip
    a, a64 = single, single64  # put back by the caller (_put_back)
    params, params64 = dict(a.named_parameters()), dict(a64.named_parameters())
    if k is not None:
        gen = torch.Generator().manual_seed((seed * 1_000_003 + step * 101 + k) % 2 ** 63)
        with torch.no_grad():
            for n, p in params.items():
                moved = convert(p, torch.float64) * (1 + PERTURB * torch.randn(p.shape, generator=gen, dtype=torch.float64))
                p.copy_(moved)
                params64[n].copy_(convert(p, torch.float64))  # both at exactly the same point
    a.zero_grad(set_to_none=True)
    a64.zero_grad(set_to_none=True)
    record = TieFlips() if k is None else contextlib.nullcontext()
    with fallback, same_draws(seed, step), record:
        loss64 = run(a64, args64)
    if k is None:
        fallback.spreads.selects = bool(record.recorded)
        if not record.recorded:
            return {}
    flips = TieFlips(record.recorded) if k is None else contextlib.nullcontext()
    with same_draws(seed, step), flips:
        loss = run(a, args)
    if k is None and not flips.flips:
        return {}
    loss.backward()
    with fallback:
        loss64.backward()
    return {"loss": _rel(loss.detach(), loss64.detach())} | \
        {f"grad {n}": _rel(p.grad, params64[n].grad) for n, p in params.items()}
