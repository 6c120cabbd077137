"""Annotation lint: mistakes an annotation can carry, found before any rank runs.

Two kinds of finding, each with the fix:

* static: :func:`nnscaler.ops.lint.lint_static` (every ``register_op`` runs it and warns);
* dynamic (the function run once on sample inputs, in float64, in this process):
  - *mixing*: for each spatial identifier that an output holds, one slice of an input along it is
    perturbed; if any *other* slice of an output changes, the function mixes values along that dim
    (softmax, cumsum, flip, sort, a convolution window) and a split would cut what it mixes.
  - *backward*: an operator whose backward is its own (a ``torch.library`` custom op with
    ``register_autograd``, a ``torch.autograd.Function``) has it checked against its forward by
    ``torch.autograd.gradcheck`` (finite differences, float64, the sample's small lengths): the
    harness's single-device reference runs that same backward, so a wrong one would match itself.
  - *additivity*: for each ``+`` identifier, the inputs holding it are cut in two along it and the
    function run on each half (inputs lacking it whole on both, as :func:`~nnscaler.dimops.partition.op_layout`
    replicates them, or, written with a leading ``+``, whole on the first half and zero on the second,
    as a partial value is laid out); the halves must add up to the whole result. A mean, a max or any
    non-linear use of the dim fails this. Specs with a partition-aware ``local`` kernel are skipped
    (the kernel, not the function, defines what a shard computes); so are the spec's ``coupled``
    identifiers under *mixing* (batch statistics: the kernel's own collective joins the slices).

The real verdict stays with the harness on real ranks; lint only answers "is this annotation
plausible?" in milliseconds, with a sentence a user can act on.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

from nnscaler.dimops.binding import BoundAnno
from nnscaler.dimops.grammar import SPATIAL, VALUE
from nnscaler.ops.lint import Finding, lint_static
from nnscaler.ops.spec import OpSpec, resolve
from nnscaler.runtime.partitioned import as_tuple

from verify.cases.samples import make_sample

PERTURB = 0.75  # added to one slice; large against rounding, small enough to stay in any domain
RTOL = 1e-7  # float64: anything above this is a real change, not rounding


def _first_dim(dims, ident: str) -> int | None:
    return next((d for d, ids in enumerate(dims or ()) if ids[0] == ident), None)


def _block(bound: BoundAnno, dims, d: int, ident: str) -> int:
    """Elements of real dim ``d`` per unit of ``ident`` (its hidden factors, for a group ``(h d)``)."""
    n = 1
    for i in dims[d][1:]:
        n *= int(i) if i.isdigit() else bound.sizes[i]
    return n


def _run(spec: OpSpec, inputs: list, sizes: dict) -> tuple:
    with torch.no_grad():
        return as_tuple(spec.fn(*inputs, **resolve(dict(spec.kwargs), sizes)))


def _float64(x):
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _changed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    scale = max(float(a.abs().max()) if a.numel() else 0.0, 1.0)
    return (a - b).abs() > RTOL * scale


def _mixing(spec: OpSpec, bound: BoundAnno, inputs: list, base: tuple) -> list[Finding]:
    found = []
    markers = bound.markers
    for ident in bound.identifiers():
        if markers.get(ident) != SPATIAL or bound.sizes.get(ident, 1) < 3 or ident in spec.coupled:
            continue  # (a coupled identifier mixes by design: its local kernel shares the statistics)
        holders = [k for k, dims in enumerate(bound.outputs) if _first_dim(dims, ident) is not None
                   and isinstance(base[k], torch.Tensor) and base[k].is_floating_point()]
        source = next((k for k, (x, dims) in enumerate(zip(inputs, bound.inputs))
                       if isinstance(x, torch.Tensor) and x.is_floating_point() and _first_dim(dims, ident) is not None),
                      None)
        if not holders or source is None:
            continue
        d = _first_dim(bound.inputs[source], ident)
        blk = _block(bound, bound.inputs[source], d, ident)
        j = bound.sizes[ident] // 2
        bumped = list(inputs)
        x = inputs[source].clone()
        x.narrow(d, j * blk, blk).add_(PERTURB)
        bumped[source] = x
        try:
            outs = _run(spec, bumped, bound.sizes)
        except Exception:  # noqa: BLE001  (a domain error on the perturbed input proves nothing)
            continue
        for k in holders:
            dims = bound.outputs[k]
            od = _first_dim(dims, ident)
            oblk = _block(bound, dims, od, ident)
            diff = _changed(outs[k].double(), base[k].double())
            mask = torch.ones(diff.shape[od], dtype=torch.bool)
            mask[j * oblk:(j + 1) * oblk] = False
            if bool(diff.index_select(od, mask.nonzero().flatten()).any()):
                found.append(Finding(spec.name, ident, "mixes", (
                    f"changing one slice along {ident!r} (input {source}) changes other slices of output {k}: the "
                    f"function mixes values along that dim (a softmax, cumsum, flip, sort or window), so it cannot "
                    f"be split there. Write '{ident}^' in {spec.annotation!r}, or give a partition-aware local kernel")))
                break
    return found


def _halves(x: torch.Tensor, d: int, blk: int, n: int, blocks: int = 1) -> list[torch.Tensor]:
    """The two halves of ``x`` along ``ident`` at dim ``d``; with ``blocks`` (``(2 i)``: the dim is that
    many blocks of ``ident``), each half takes its half of every block, as a split lays it out."""
    if blocks > 1:
        y = x.unflatten(d, (blocks, x.shape[d] // blocks))
        return [p.flatten(d, d + 1) for p in _halves(y, d + 1, blk, n)]
    half = (n // 2) * blk
    return [x.narrow(d, 0, half), x.narrow(d, half, x.shape[d] - half)]


def _blocked_dim(dims, ident: str) -> tuple[int, int] | None:
    """(dim, block count) where ``ident`` follows fixed counts in a group (``(2 i)``: 2 blocks)."""
    for d, ids in enumerate(dims or ()):
        j = next((k for k, i in enumerate(ids) if not i.isdigit()), None)
        if j and ids[j] == ident:
            return d, math.prod(int(i) for i in ids[:j])
    return None


def _additivity(spec: OpSpec, bound: BoundAnno, inputs: list, base: tuple) -> list[Finding]:
    found = []
    for ident in bound.identifiers():
        n = bound.sizes.get(ident, 1)
        if bound.markers.get(ident) != VALUE or n < 2 or n % 2:
            continue
        parts: list[list] = [[], []]
        for x, dims, anno in zip(inputs, bound.inputs, bound.anno.inputs):
            d = _first_dim(dims, ident) if isinstance(x, torch.Tensor) else None
            cut = _blocked_dim(dims, ident) if isinstance(x, torch.Tensor) and d is None else None
            if d is not None:
                for h, piece in enumerate(_halves(x, d, _block(bound, dims, d, ident), n)):
                    parts[h].append(piece)
            elif cut is not None:
                per = math.prod(int(i) if i.isdigit() else bound.sizes[i] for i in dims[cut[0]][1:]) // n
                for h, piece in enumerate(_halves(x, cut[0], per, n, cut[1])):
                    parts[h].append(piece)
            elif isinstance(x, torch.Tensor) and x.is_floating_point() and anno.partial:
                parts[0].append(x)  # a leading '+' (a bias added after the contraction): held by one rank
                parts[1].append(torch.zeros_like(x))
            else:
                parts[0].append(x)
                parts[1].append(x)
        local = dict(bound.sizes, **{ident: n // 2})
        try:
            halves = [_run(spec, p, local) for p in parts]
        except Exception as exc:  # noqa: BLE001
            found.append(Finding(spec.name, ident, "failed", f"running on half of {ident!r} raised {type(exc).__name__}: {exc}"))
            continue
        for k, dims in enumerate(bound.outputs):
            y = base[k]
            if dims is None or _first_dim(dims, ident) is not None or not isinstance(y, torch.Tensor) \
                    or not y.is_floating_point():
                continue
            total = halves[0][k].double() + halves[1][k].double()
            if total.shape != y.shape or bool(_changed(total, y.double()).any()):
                found.append(Finding(spec.name, ident, "not-additive", (
                    f"output {k} of the two halves along {ident!r} does not add up to the whole result: '{ident}+' "
                    f"promises partial sums, but the function uses that dim non-linearly (a mean, max, norm or "
                    f"product). Write '{ident}^', or give a partition-aware local kernel (see opzoo)")))
                break
    return found


def own_backward(spec: OpSpec) -> bool:
    """Whether the operator's backward is written by its author rather than derived by autograd."""
    fn = spec.fn
    if isinstance(fn, torch._library.custom_ops.CustomOpDef):
        return fn._backward_fn is not None  # (no public accessor in torch.library for this)
    owner = getattr(fn, "__self__", fn)  # a Function registered as its ``apply``
    return isinstance(owner, type) and issubclass(owner, torch.autograd.Function)


def _backward(spec: OpSpec, inputs: list, sizes: dict) -> list[Finding]:
    """``gradcheck`` of an operator's own backward against finite differences of its forward."""
    leaves = [x.detach().requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
              for x in inputs]
    if not any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves):
        return []
    kwargs = resolve(dict(spec.kwargs), sizes)
    call = spec.fn.apply if isinstance(spec.fn, type) else spec.fn  # a Function class, or a callable

    def floating(*args):
        return tuple(o for o in as_tuple(call(*args, **kwargs)) if isinstance(o, torch.Tensor) and o.is_floating_point())
    try:
        torch.autograd.gradcheck(floating, tuple(leaves), eps=1e-6, atol=1e-5, rtol=1e-4)
    except Exception as exc:  # noqa: BLE001  (GradcheckError, or a backward that cannot run)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return [Finding(spec.name, "", "backward", f"its own backward disagrees with its forward (torch.autograd."
                                                    f"gradcheck in float64: {first}); fix the function given to "
                                                    f"register_autograd / the Function's backward")]
    return []


def lint_dynamic(spec: OpSpec, seed: int = 0, base: int = 4) -> list[Finding]:
    """Findings from running the function once on float64 sample inputs (and once per check)."""
    try:
        sample = make_sample(spec, torch.float64, seed, base)
        inputs = [_float64(x) for x in sample.inputs]
        out = _run(spec, inputs, sample.bound.sizes)
        again = _run(spec, inputs, sample.bound.sizes)
    except Exception as exc:  # noqa: BLE001
        return [Finding(spec.name, "", "failed", f"cannot run on sample inputs: {type(exc).__name__}: {exc}")]
    deterministic = all(not isinstance(a, torch.Tensor) or torch.equal(a, b) for a, b in zip(out, again))
    if not deterministic:
        return []  # random operators are judged by the harness with a shared random stream
    found = _mixing(spec, sample.bound, inputs, out)
    if own_backward(spec):
        found += _backward(spec, inputs, sample.bound.sizes)
    if spec.local is None:
        found += _additivity(spec, sample.bound, inputs, out)
    return found


def lint(specs: Iterable[OpSpec], dynamic: bool = True) -> list[Finding]:
    """Static (and, with ``dynamic``, run-once) findings for every spec."""
    out = []
    for spec in specs:
        found = lint_static(spec)
        if dynamic and not found:
            found = lint_dynamic(spec)
        out += found
    return out
